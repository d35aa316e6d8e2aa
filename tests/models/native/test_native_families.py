"""The native runner's other families: Gemma 3 (query/key norms, sandwich norms, GeGLU, the embedding scale,
sliding-window layers with their own RoPE base) and Qwen 3 (query/key norms), on tiny random configs.

Same contract as for Llama (tests/models/native/test_native_llama.py): logits equal transformers' to float tolerance,
and row invariance bitwise in every weight format — chains, trees and batched rows, with prompts longer than the window.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import kernels_or_skip, needs_kernels
from helpers.native import (
    FAMILIES,
    SETTING_NAMES,
    SETTINGS,
    VOCAB,
    WINDOW,
    assert_rows_equal_single_steps,
    gemma3,
    loaded_as,
    qwen3,
    random_ids,
)
from helpers.reference import no_cache_logits

import specdecode as sd
from specdecode.models.native.architecture import unsupported_reason
from specdecode.models.native.runner import NativeRunner
from specdecode.models.native.torch_path import last_visible
from specdecode.sampling.tree import attention_mask, depths


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    torch.testing.assert_close(actual, expected, atol=tol * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers_past_the_window(family):
    model = FAMILIES[family]()
    assert unsupported_reason(model) is None
    ids = random_ids(40, seed=3)
    reference = no_cache_logits(model, ids)
    runner = NativeRunner(model, vocab_size=VOCAB)
    _close(runner.forward(torch.tensor(ids)), reference)
    runner.reset()  # a prefill (one masked attention call), then chains of several sizes
    runner.prefill(torch.tensor(ids[:13]))
    pieces, at = [], 13
    for size in (1, 5, 1, 9, 11):
        pieces.append(runner.forward(torch.tensor(ids[at : at + size])))
        at += size
    _close(torch.cat(pieces), reference[13:])


def test_gemma_window_and_rope_bases_matter():
    """The control: the runner follows the window and each layer's RoPE base, so changing either changes the
    logits (a runner that ignored them would still pass the test above only by luck)."""
    ids = random_ids(40, seed=3)
    model = gemma3()
    wide = gemma3(window=64)
    assert not torch.allclose(no_cache_logits(model, ids)[WINDOW:], no_cache_logits(wide, ids)[WINDOW:], atol=1e-3)
    _close(NativeRunner(wide, vocab_size=VOCAB).forward(torch.tensor(ids)), no_cache_logits(wide, ids))
    swapped = gemma3()
    swapped.config.rope_parameters["sliding_attention"]["rope_theta"] = 1e6
    other = type(swapped.model.rotary_emb)(swapped.config)
    swapped.model.rotary_emb = other
    assert not torch.allclose(no_cache_logits(swapped, ids), no_cache_logits(model, ids), atol=1e-3)
    _close(NativeRunner(swapped, vocab_size=VOCAB).forward(torch.tensor(ids)), no_cache_logits(swapped, ids))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_close_to_transformers(family):
    model = FAMILIES[family]().to(torch.bfloat16)
    ids = random_ids(30, seed=4)
    logits = NativeRunner(model, vocab_size=VOCAB).forward(torch.tensor(ids))
    reference = no_cache_logits(model, ids)
    assert (logits - reference).norm() / reference.norm() < 0.03


def test_last_visible_keeps_each_rows_last_window_keys():
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 0, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    expected = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(last_visible(mask, 2), expected)
    assert torch.equal(last_visible(mask, 0), mask)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(SETTING_NAMES, SETTINGS)
def test_k_token_pass_is_bitwise_k_single_steps(family, dtype, quantization, group_size, kernels):
    runner = loaded_as(FAMILIES[family](), dtype, quantization, group_size, kernels).new_runner()
    ids = random_ids(180, seed=5)
    for context in (1, 6, 150):  # inside the window, at its edge, far past it (and past one attention chunk)
        for k in (1, 2, 3, 7, 9, 16, 24):
            assert_rows_equal_single_steps(runner, ids[:context], ids[context : context + k])


def _path(parents: torch.Tensor, node: int) -> list[int]:
    """Rows of a tree pass (0 = the root) from the root to ``node`` (-1 = the root itself)."""
    path, at = [], node
    while at >= 0:
        path.insert(0, at + 1)
        at = int(parents[at])
    return [0, *path]


@pytest.mark.parametrize("window", [WINDOW, 3])  # 3: the window cuts into the branch itself
@pytest.mark.parametrize(SETTING_NAMES, SETTINGS[:3] + SETTINGS[-1:])
def test_every_gemma_tree_row_is_bitwise_its_branch(window, dtype, quantization, group_size, kernels):
    model = gemma3(window=window)
    loaded = loaded_as(model, dtype, quantization, group_size, kernels)
    runner = loaded.new_runner()
    prefix = random_ids(20, seed=8)
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2, 4, 7, -1])
    tokens = random_ids(len(parents) + 1, seed=9)
    runner.prefill(torch.tensor(prefix))
    cached = runner.length
    positions = cached + torch.cat([torch.zeros(1, dtype=torch.int64), depths(parents)])
    tree = runner.forward(torch.tensor(tokens), positions=positions, attn_mask=attention_mask(parents, cached))
    chain = loaded.new_runner()
    for node in range(-1, len(parents)):
        chain.reset()
        chain.prefill(torch.tensor(prefix))
        expected = chain.forward(torch.tensor([tokens[r] for r in _path(parents, node)]))
        assert torch.equal(tree[node + 1], expected[-1]), f"node {node}"
    kept = _path(parents, 7)  # root -> 1 -> 4 -> 7
    runner.retain(cached, [cached + r for r in kept])
    chain.reset()
    chain.prefill(torch.tensor(prefix))
    expected = chain.forward(torch.tensor([tokens[r] for r in kept] + [3]))
    assert torch.equal(runner.forward(torch.tensor([3]))[0], expected[-1])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(SETTING_NAMES, SETTINGS[::2])
def test_a_batch_of_requests_gives_each_its_own_logits_bitwise(family, dtype, quantization, group_size, kernels):
    target = loaded_as(FAMILIES[family](), dtype, quantization, group_size, kernels)
    ids = random_ids(200, seed=7)
    contexts = [ids[:1], ids[5:14], ids[20:170], ids[40:43]]  # mixed cache lengths, inside and past the window
    chunks = [[ids[1]], ids[14:18], [ids[170]], ids[43:55]]
    batch, alone = [target.new_runner() for _ in contexts], target.new_runner()
    for runner, context in zip(batch, contexts, strict=True):
        runner.capture_hidden = True
        runner.prefill(torch.tensor(context))
    alone.capture_hidden = True
    together = batch[0].forward_batch(batch, [torch.tensor(c) for c in chunks])
    for context, chunk, logits, runner in zip(contexts, chunks, together, batch, strict=True):
        alone.reset()
        alone.prefill(torch.tensor(context))
        assert torch.equal(logits, alone.forward(torch.tensor(chunk)))
        assert torch.equal(runner.hidden, alone.hidden)


@needs_kernels
@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernels_compute_what_the_torch_path_computes(family):
    """The compiled decoder's Gemma/Qwen options (norms, GELU, windows, RoPE tables) against the torch path over
    the same int8 weights: equal up to the kernels' int16 activations and float16 cache."""
    model = FAMILIES[family]()
    ids = random_ids(60, seed=2)
    fast = loaded_as(model, "float32", "int8", 32, "kernels").new_runner()
    slow = loaded_as(model, "float32", "int8", 32, "torch").new_runner()
    assert fast.uses_kernels and not slow.uses_kernels
    a, b = fast.forward(torch.tensor(ids)), slow.forward(torch.tensor(ids))
    assert (a - b).norm() / b.norm() < 0.02
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_quantized_gemma_in_transformers_keeps_the_embedding_scale():
    """A quantized Gemma's embedding (our QuantizedEmbedding) still scales its rows: transformers' own forward
    over the quantized modules agrees with our runner."""
    loaded = loaded_as(gemma3(), "float32", "int8", 32, "kernels")
    ids = random_ids(20, seed=6)
    with torch.no_grad():
        hf = loaded.model(torch.tensor([ids]), use_cache=False).logits[0]
    ours = loaded.new_runner().forward(torch.tensor(ids))
    assert (ours - hf).norm() / hf.norm() < 0.03


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("float32", "int4")])
def test_greedy_speculation_is_identical_to_plain_decoding(family, dtype, quantization):
    target = sd.load_model(FAMILIES[family](seed=1), dtype=dtype, quantization=quantization)
    assert target.backend == "native"
    prompt = random_ids(12, seed=4) * 3  # longer than the window, with repeats for prompt lookup
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = sd.autoregressive_generate(target, prompt, params).token_ids
    for proposer in (sd.PromptLookupProposer(), sd.LayerSkipProposer(target, 2)):
        for gamma in (3, 8):
            out = sd.SpeculativeDecoder(target, proposer, gamma=gamma).generate(prompt, params)
            assert out.token_ids == plain, (type(proposer).__name__, gamma)
    tree = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(branches=3), gamma=4).generate(prompt, params)
    assert tree.token_ids == plain


def test_unsupported_configs_say_why():
    capped = gemma3(final_logit_softcapping=30.0)
    assert "final_logit_softcapping" in unsupported_reason(capped)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        NativeRunner(capped, vocab_size=VOCAB)
    loaded = sd.load_model(capped)
    assert loaded.backend == "transformers"
    assert "transformers runner (not native: final_logit_softcapping is set)" in loaded.describe()
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        sd.load_model(capped, backend="native")
    assert "bidirectional" in unsupported_reason(gemma3(use_bidirectional_attention=True))


def test_describe_names_family_engine_and_formats():
    from specdecode.kernels import ops

    line = loaded_as(gemma3(), "float32", "int4", 32, "kernels").describe()
    engine = "compiled kernels" if ops() is not None else "PyTorch ops"
    assert f"native runner (Gemma 3 family, {engine})" in line
    assert "28 int4/32" in line and "1 int8 head" in line  # 4 layers x 7 matrices; the head int8 per row
    assert "weights dense float32" in sd.load_model(qwen3()).describe()


@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_every_instruction_set_runs_the_gemma_and_qwen_options_to_the_same_bits(variant, monkeypatch):
    """The AVX2 and plain-C builds of the compiled decoder (query/key norms, sandwich norms, GELU, windows,
    per-layer RoPE tables) give bitwise this machine's build's logits, a chain past the window and a tree."""
    import copy

    from specdecode.kernels import ops

    kernels_or_skip(variant)  # skips where that build is unavailable
    ids = random_ids(40, seed=13)
    parents = torch.tensor([-1, -1, 0, 1, 2])
    for family in FAMILIES.values():
        model = family()
        runners = []
        for build in ("native", variant):
            monkeypatch.setenv("SPECDECODE_KERNELS", build)
            runners.append(sd.load_model(copy.deepcopy(model), quantization="int8").new_runner())
        monkeypatch.delenv("SPECDECODE_KERNELS")
        assert all(r.uses_kernels for r in runners)
        assert [r.decoder.lm_head.handle.kernels for r in runners] == [ops("native"), ops(variant)]  # two builds ran
        chains = [r.forward(torch.tensor(ids[:30])) for r in runners]
        trees = []
        for runner in runners:
            positions = 30 + torch.cat([torch.zeros(1, dtype=torch.int64), depths(parents)])
            mask = attention_mask(parents, 30)
            trees.append(runner.forward(torch.tensor(ids[30:36]), positions=positions, attn_mask=mask))
        assert torch.equal(chains[0], chains[1]) and torch.equal(trees[0], trees[1])
