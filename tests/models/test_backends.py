"""Choosing a runner: native for the Llama family, transformers for everything else; both give one answer."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.models import tiny_llama
from transformers import GPT2Config, GPT2LMHeadModel

import specdecode as sd
from specdecode.models.native.runner import NativeRunner
from specdecode.models.transformers_runner import TransformersRunner, cache_keyword


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=48, n_embd=32, n_layer=2, n_head=4, n_positions=128)).eval()


def test_auto_picks_native_for_llama_and_transformers_otherwise():
    llama = sd.load_model(tiny_llama(32, seed=1))
    assert llama.backend == "native" and isinstance(llama.new_runner(), NativeRunner)
    gpt2 = sd.load_model(tiny_gpt2())
    assert gpt2.backend == "transformers" and isinstance(gpt2.new_runner(), TransformersRunner)
    with pytest.raises(ValueError, match="native runner does not support"):
        sd.load_model(tiny_gpt2(), backend="native")
    with pytest.raises(ValueError, match="backend"):
        sd.load_model(tiny_gpt2(), backend="fast")


def test_runners_agree_on_logits_and_prefill_matches_forward():
    model = tiny_llama(32, seed=2)
    ids = torch.randint(0, 32, (30,), generator=torch.Generator().manual_seed(0))
    outputs = []
    for backend in ("native", "transformers"):
        runner = sd.load_model(model, backend=backend).new_runner()
        runner.prefill(ids[:20])
        assert runner.length == 20
        outputs.append(runner.forward(ids[20:]))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=0)


def test_greedy_identity_on_a_non_llama_model():
    target = sd.load_model(tiny_gpt2())
    params = sd.SamplingParams(max_new_tokens=40)
    prompt = [1, 2, 3, 4, 1, 2, 3]
    plain = sd.autoregressive_generate(target, prompt, params)
    for proposer in (sd.PromptLookupProposer(), sd.DraftModelProposer(target)):
        assert sd.SpeculativeDecoder(target, proposer, gamma=3).generate(prompt, params).token_ids == plain.token_ids


def test_self_speculation_on_native_shares_the_fused_weights():
    target = sd.load_model(tiny_llama(32, seed=3, num_layers=3))
    draft = sd.LayerSkipProposer(target, 2)
    assert draft.model.backend == "native"
    full, part = target.new_runner(), draft.model.new_runner()
    assert part.decoder.layers[0].qkv.weight.data_ptr() == full.decoder.layers[0].qkv.weight.data_ptr()


def _tree_pass(runner, newest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree over the cache: newest token, children 5 and 7 of it, 9 under 7; logits and hidden states."""
    start = runner.length
    tokens = torch.tensor([newest, 5, 7, 9])
    positions = torch.tensor([start, start + 1, start + 1, start + 2])
    mask = torch.zeros(4, start + 4, dtype=torch.bool)
    mask[:, :start] = True
    for row, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 2, 3]]):
        mask[row, [start + a for a in ancestors]] = True
    return runner.forward(tokens, positions, mask), runner.hidden.clone()


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_tree_pass_then_retain_equals_the_chain_of_the_kept_branch(backend):
    model = tiny_llama(32, seed=4)
    ids = torch.randint(0, 32, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    target = sd.load_model(model, backend=backend)
    tree, chain = target.new_runner(), target.new_runner()
    for runner in (tree, chain):
        runner.capture_hidden = True
        runner.prefill(torch.tensor(ids[:-1]))
    start = tree.length
    tree_logits, tree_hidden = _tree_pass(tree, ids[-1])
    tree.retain(start, [start, start + 2, start + 3])  # keep newest -> 7 -> 9, drop 5
    assert tree.length == start + 3
    after_tree = tree.forward(torch.tensor([11]))
    chain_logits = chain.forward(torch.tensor([ids[-1], 7, 9, 11]))
    exact = backend == "native"  # row invariance; transformers reduces a k-row pass in another order
    check = torch.testing.assert_close if not exact else lambda a, b: torch.testing.assert_close(a, b, atol=0, rtol=0)
    check(tree_logits[[0, 2, 3]], chain_logits[:3])
    check(after_tree[0], chain_logits[3])
    check(tree_hidden[[0, 2, 3]], chain.hidden[:3])
    with pytest.raises(ValueError, match="ascending"):
        tree.retain(start, [start + 2, start + 1])


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_captured_hidden_states_are_the_pre_norm_features(backend):
    model = tiny_llama(32, seed=5)
    ids = torch.randint(0, 32, (9,), generator=torch.Generator().manual_seed(2))
    runner = sd.load_model(model, backend=backend).new_runner()
    runner.capture_hidden = True
    runner.prefill(ids)
    with torch.no_grad():
        expected = model(ids[None], output_hidden_states=True).hidden_states[-1][0]  # after the final norm
        torch.testing.assert_close(model.model.norm(runner.hidden), expected, atol=1e-5, rtol=0)


class OlderForwardLlama(transformers.LlamaForCausalLM):
    """A Llama whose ``forward`` takes its cache as ``past_key_values`` (transformers before 5.2x's ``cache``) and,
    like those versions, lets an unknown keyword pass unused."""

    def forward(
        self,
        input_ids=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        logits_to_keep=0,
        attention_mask=None,
        **unused,
    ):
        return super().forward(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **{cache_keyword(transformers.LlamaForCausalLM): past_key_values},
        )


def test_the_runner_hands_its_cache_over_by_the_keyword_the_model_takes():
    """On a model whose forward knows only ``past_key_values`` the runner still decodes with its cache: the same
    greedy tokens as the model with today's keyword (a cache passed as ``cache=`` would be dropped silently)."""
    model = tiny_llama(64, seed=3)
    older = OlderForwardLlama(model.config).eval()
    older.load_state_dict(model.state_dict())
    assert cache_keyword(older) == "past_key_values"
    params = sd.SamplingParams(max_new_tokens=12)
    expected = sd.autoregressive_generate(sd.load_model(model, backend="transformers"), [5, 9, 2, 7], params)
    got = sd.autoregressive_generate(sd.load_model(older, backend="transformers"), [5, 9, 2, 7], params)
    assert got.token_ids == expected.token_ids
