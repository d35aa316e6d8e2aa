"""The transformers runner on sliding-window models (issue 20): its cache keeps every position, so rollback and
token trees stay exact past the window, while the logits stay those of the model's own windowed attention."""

from __future__ import annotations

import pytest
import torch
from helpers.models import perturbed, randomized
from helpers.reference import no_cache_logits
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Lfm2Config,
    Lfm2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)

import specdecode as sd
from specdecode.models.transformers_runner import TransformersRunner

VOCAB = 128
WINDOW = 8
HYBRID = ("sliding_attention", "full_attention", "sliding_attention")


def tiny_gemma3(seed: int, layer_types: tuple[str, ...] = HYBRID, attention: str = "sdpa") -> Gemma3ForCausalLM:
    """A random Gemma 3 text model (hidden 64, window 8) with peaked logits and no EOS."""
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=list(layer_types),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        attn_implementation=attention,
    )
    return _random(Gemma3ForCausalLM, config, seed)


def tiny_mistral(seed: int, attention: str = "sdpa") -> MistralForCausalLM:
    """A random 2-layer Mistral with window 8: no ``layer_types``, every layer sliding, one mask for all."""
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        attn_implementation=attention,
    )
    return _random(MistralForCausalLM, config, seed)


def _random(model_cls, config, seed: int):
    """Random weights large enough to move every logit; the head scaled up so the law is far from uniform."""
    torch.manual_seed(seed)
    model = randomized(model_cls(config).eval(), seed, weight_std=0.2)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


MODELS = {
    "gemma3-hybrid": lambda seed, attention="sdpa": tiny_gemma3(seed, HYBRID, attention),
    "gemma3-sliding": lambda seed, attention="sdpa": tiny_gemma3(seed, ("sliding_attention",) * 2, attention),
    "mistral": tiny_mistral,
}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def gemma() -> Gemma3ForCausalLM:
    return tiny_gemma3(seed=0)


def test_the_cache_holds_every_position_of_every_layer(gemma):
    runner = TransformersRunner(gemma, VOCAB)
    runner.prefill(torch.tensor(random_ids(30, seed=1)))
    assert [layer.keys.shape[-2] for layer in runner._cache.layers] == [30, 30, 30]
    assert runner.supports_trees


def test_prefill_rollback_and_reforward_match_a_full_forward(gemma):
    ids = random_ids(34, seed=2)
    runner = TransformersRunner(gemma, VOCAB)
    runner.prefill(torch.tensor(ids[:30]))
    runner.forward(torch.tensor(ids[30:]))
    runner.rollback_to(25)
    assert runner.length == 25
    close(runner.forward(torch.tensor(ids[25:])), no_cache_logits(gemma, ids)[25:])


@pytest.mark.parametrize("name", MODELS)
def test_rounds_of_forward_and_rollback_match_a_fresh_full_forward(name):
    model = MODELS[name](seed=3)
    generator = torch.Generator().manual_seed(4)
    ids = random_ids(20, seed=5)
    runner = TransformersRunner(model, VOCAB)
    runner.prefill(torch.tensor(ids))
    for _ in range(12):
        k = int(torch.randint(1, 6, (), generator=generator))
        new = torch.randint(0, VOCAB, (k,), generator=generator).tolist()
        logits = runner.forward(torch.tensor(new))
        ids += new
        close(logits, no_cache_logits(model, ids)[-k:])
        keep = len(ids) - int(torch.randint(0, k + 1, (), generator=generator))  # reject up to all k
        runner.rollback_to(keep)
        ids = ids[:keep]
    assert runner.length == len(ids) > 3 * WINDOW


def tree_pass(runner: TransformersRunner, newest: int) -> torch.Tensor:
    """A tree over the cache: newest token, children 5 and 7 of it, 9 under 7, 3 under 9; its row logits."""
    start = runner.length
    tokens = torch.tensor([newest, 5, 7, 9, 3])
    positions = torch.tensor([start, start + 1, start + 1, start + 2, start + 3])
    mask = torch.zeros(5, start + 5, dtype=torch.bool)
    mask[:, :start] = True
    for row, ancestors in enumerate([[0], [0, 1], [0, 2], [0, 2, 3], [0, 2, 3, 4]]):
        mask[row, [start + a for a in ancestors]] = True
    return runner.forward(tokens, positions, mask)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_tree_rows_and_retain_equal_one_token_steps_along_each_path(name, attention):
    model = MODELS[name](seed=6, attention=attention)
    ids = random_ids(21, seed=7)
    tree, chain = TransformersRunner(model, VOCAB), TransformersRunner(model, VOCAB)
    for runner in (tree, chain):
        runner.prefill(torch.tensor(ids[:-1]))
    start = tree.length
    rows = tree_pass(tree, ids[-1])
    for path, nodes in (([ids[-1], 5], [0, 1]), ([ids[-1], 7, 9, 3], [0, 2, 3, 4])):
        chain.rollback_to(start)
        steps = torch.cat([chain.forward(torch.tensor([token])) for token in path])
        close(rows[nodes], steps)
    tree.retain(start, [start, start + 2, start + 3])  # keep newest -> 7 -> 9, drop 5 and 3
    chain.rollback_to(start + 3)
    close(tree.forward(torch.tensor([11, 12])), chain.forward(torch.tensor([11, 12])))


def test_the_tree_mask_needs_the_window(gemma):
    """Power check: with the tree mask reaching sliding layers unwindowed, the rows differ."""
    ids = random_ids(21, seed=8)
    windowed, unwindowed = TransformersRunner(gemma, VOCAB), TransformersRunner(gemma, VOCAB)
    unwindowed._window = None
    for runner in (windowed, unwindowed):
        runner.prefill(torch.tensor(ids[:-1]))
    assert (tree_pass(windowed, ids[-1]) - tree_pass(unwindowed, ids[-1])).abs().max() > 1e-2


@pytest.fixture(scope="module")
def target(gemma) -> sd.LoadedModel:
    loaded = sd.load_model(gemma, backend="transformers")
    assert loaded.backend == "transformers"
    return loaded


def greedy_reference(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(no_cache_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_speculative_decoding_past_the_window_is_greedy_identical(gemma, target):
    prompt = random_ids(10, seed=9) * 3  # 30 tokens, repetitive so prompt lookup finds matches
    params = sd.SamplingParams(max_new_tokens=40)
    plain = sd.autoregressive_generate(target, prompt, params).token_ids
    assert plain == greedy_reference(gemma, prompt, 40)
    draft = sd.load_model(perturbed(gemma, seed=10, noise=0.05))
    proposers = {
        "draft": sd.DraftModelProposer(draft),
        "lookup": sd.PromptLookupProposer(),
        "tree": sd.PromptLookupProposer(branches=3),
    }
    for name, proposer in proposers.items():
        out = sd.SpeculativeDecoder(target, proposer, gamma=4).generate(prompt, params).token_ids
        assert out == plain, name


def test_a_rollback_mid_decode_never_raises(target):
    """Rounds that feed 4 tokens and keep 1, long after the window is full (the crash of issue 20)."""
    runner = target.new_runner()
    runner.prefill(torch.tensor(random_ids(30, seed=11)))
    for step in range(20):
        runner.forward(torch.tensor(random_ids(4, seed=12 + step)))
        runner.rollback_to(runner.length - 3)  # keep one of the 4: the window is long full
    assert runner.length == 30 + 20


def test_a_cache_that_cannot_roll_back_is_refused_at_construction():
    config = Lfm2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        layer_types=["conv", "full_attention"],
    )
    model = Lfm2ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="cannot roll back"):
        TransformersRunner(model, VOCAB)
    with pytest.raises(ValueError, match="cannot roll back"):
        sd.load_model(model).new_runner()
