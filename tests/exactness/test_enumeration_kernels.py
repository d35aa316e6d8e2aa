"""The engine's law enumerated through the compiled sampling code a CPU run samples with (issue 53).

``engine_law(..., through_kernels=True)`` runs every decision of exact mode through the ops a float32 CPU request
runs: the chain rule is ``exact_chain`` itself (``verify.speculative_sample``'s kernel path, fed explicit uniforms by
``enumeration.KernelEnumerator``) and every draw ``inverse_cdf_rows``; each decision's law is read off the op by
bisection on its float64 uniforms (to the last bit, as tests/kernels/test_kernel_laws.py does), so the law is the
compiled code's, not the torch fallback's. Bound as tests/exactness/test_enumeration.py: TV < 1e-6 (float32 target
probabilities leave ~1e-8). Controls that reach the compiled code and must miss by ≥ 100× the bound: the mutant builds
of the kernels (``kernels.MUTANTS``, a fault compiled into sampling.h, selected with ``SPECDECODE_KERNELS`` as a user
would select a build), and, for point-mass chains (whose residual is p without the guess: the residual mutant changes
max(0, p − q) only), the real op with its draw uniform split 1% to p (tests/helpers/enumeration.residual_mixed_with_p).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.enumeration import BOUND, LOOKUP_PROMPT, MIXED, T1, case, residual_mixed_with_p
from helpers.kernels import unavailable, use_build
from helpers.models import SMALL_VOCAB, perturbed, tiny_llama

import specdecode as sd
import specdecode.sampling.verify
from specdecode import kernels
from specdecode.exactness.enumeration import engine_law, interval_law, prefix_law, total_variation

FIRST = sd.SamplingParams(temperature=1.0, max_new_tokens=2)  # one round of one guess decides the first token


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    if kernels.ops("native") is None:
        unavailable("the CPU kernels did not build here")
    return sd.load_model(tiny_llama(SMALL_VOCAB, seed=0))


@pytest.fixture(scope="module")
def draft(target) -> sd.LoadedModel:
    return sd.load_model(perturbed(target.model, seed=1, noise=0.15))


def kernel_law(decoder, prompt, params, tokens):
    """engine_law through the kernels, and the number of exact_chain calls it made (it must have made some)."""
    calls = []
    chain_kernels = specdecode.sampling.verify._chain_kernels

    def counted(*rows):
        calls.append(1)
        return chain_kernels(*rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(specdecode.sampling.verify, "_chain_kernels", counted)
        result = engine_law(decoder, prompt, params, tokens=tokens, through_kernels=True)
    assert calls, "no round reached the compiled chain rule"
    return result


@pytest.mark.parametrize("variant", ["native", "mutant_residual", "mutant_index"])  # V 16: the others at V 150 below
def test_a_draft_models_chain_through_the_compiled_ops_gives_the_targets_law(target, draft, variant, monkeypatch):
    """Proves the compiled chain rule in the engine: a draft model's sampled chain (T 1, gamma 1, its guesses drawn
    by the compiled inverse CDF) gives the target's law of the first token to 1e-6, enumerated through exact_chain.
    Controls: the mutant builds (1% of p mixed into max(0, p − q); every draw one index off) miss by ≥ 100× it."""
    use_build(variant, monkeypatch)
    decoder = sd.SpeculativeDecoder(target, sd.DraftModelProposer(draft), gamma=1)
    result = kernel_law(decoder, LOOKUP_PROMPT, FIRST, tokens=1)
    tv = total_variation(result.law, prefix_law(target, LOOKUP_PROMPT, FIRST, tokens=1))
    assert sum(result.law.values()) == pytest.approx(1.0, abs=1e-12)
    if variant == "native":
        assert result.runs > SMALL_VOCAB and result.accepted_mass > 0.05, result
        assert tv < BOUND, (tv, result.runs)
    else:
        assert tv > 100 * BOUND, (variant, tv)


@pytest.mark.parametrize("control", ["none", "mutant_index", "residual-mixed-1%"])
@pytest.mark.parametrize("name", ["chain/lookup", "tree/deep-wide-3-2"])
def test_point_mass_laws_through_the_compiled_ops(target, name, control, monkeypatch):
    """Proves the point-mass chain (prompt lookup through exact_chain) and a deterministic tree (its draws through
    inverse_cdf_rows) keep the target's law of two tokens to 1e-6 through the compiled ops. Controls: the
    index-shifting build; the chain op's residual draw mixed 1% with p, the tree rules' residual mixed 1% with p —
    each must miss by ≥ 100× the bound."""
    if control == "residual-mixed-1%" and name.startswith("tree"):
        pytest.skip("the tree rules' residual is torch code: test_enumeration's control; mutant_index is the kernel's")
    use_build("mutant_index" if control == "mutant_index" else "native", monkeypatch)
    if control == "residual-mixed-1%":
        chain_kernels = specdecode.sampling.verify._chain_kernels
        monkeypatch.setattr(
            specdecode.sampling.verify,
            "_chain_kernels",
            lambda *rows: residual_mixed_with_p(chain_kernels(*rows), MIXED),
        )
    decoder, prompt = case(name, target)
    result = engine_law(decoder, prompt, T1, tokens=2, through_kernels=True)
    tv = total_variation(result.law, prefix_law(target, prompt, T1, tokens=2))
    if control == "none":
        assert result.runs > 1 and result.accepted_mass > 0.05, result
        assert tv < BOUND, (name, tv, result.runs)
    else:
        assert tv > 100 * BOUND, (name, control, tv)


def test_interval_law_reads_a_step_functions_law_to_the_bit():
    """The bisection behind every kernel-enumerated decision: the law of a monotone draw u ↦ token is its intervals'
    lengths, boundaries found exactly (token 1 has none: no mass), and a draw that is not monotone is not given it."""
    edges = np.array([0.1, 0.1, 0.7])
    law = dict(interval_law(lambda u: np.searchsorted(edges, u, side="right")))
    assert law == {0: 0.1, 2: 0.7 - 0.1, 3: 1.0 - 0.7}
    shuffled = dict(interval_law(lambda u: np.array([2, 0, 1, 3])[np.searchsorted(edges, u, side="right")]))
    assert shuffled != {2: 0.1, 1: 0.7 - 0.1, 3: 1.0 - 0.7}


def test_through_kernels_refuses_a_machine_without_them(target, monkeypatch):
    monkeypatch.setenv("SPECDECODE_KERNELS", "0")
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=2)
    with pytest.raises(RuntimeError, match="kernels are not available"):
        engine_law(decoder, LOOKUP_PROMPT, T1, through_kernels=True)


@pytest.mark.slow
def test_a_draft_models_chain_of_two_tokens_through_the_compiled_ops(target, draft):
    """The joint law of two tokens (a second round after a rejection, the bonus after an acceptance): 4,600 runs,
    ~15 s; TV < 1e-6."""
    decoder = sd.SpeculativeDecoder(target, sd.DraftModelProposer(draft), gamma=1)
    params = sd.SamplingParams(temperature=1.0, max_new_tokens=4)
    result = kernel_law(decoder, LOOKUP_PROMPT, params, tokens=2)
    assert total_variation(result.law, prefix_law(target, LOOKUP_PROMPT, params, tokens=2)) < BOUND


# ------------------------------------------------------------------------------------------------ several blocks

WIDE_VOCAB = 2 * 64 + 22  # the compiled draws walk three 64-entry blocks, the last one partial (tokens 128..149)
TOP8 = sd.SamplingParams(temperature=1.0, top_k=8, max_new_tokens=3)  # top-k 8: a few dozen runs at V = 150


@pytest.fixture(scope="module")
def wide_target() -> sd.LoadedModel:
    if kernels.ops("native") is None:
        unavailable("the CPU kernels did not build here")
    return sd.load_model(tiny_llama(WIDE_VOCAB, seed=3))


def lookup_prompt(target: sd.LoadedModel) -> list[int]:
    """[5, 9, c, 5, 9]: prompt lookup guesses c, chosen as the likeliest token whose target probability after the
    prompt is in (0.1, 0.9) under top-k 8, so that the guess is accepted and rejected."""
    runner = target.new_runner()
    for c in range(WIDE_VOCAB):
        runner.reset()
        logits = runner.forward(torch.tensor([5, 9, c, 5, 9]))[-1]
        p = float(torch.softmax(sd.sampling.warp_logits(logits[None], 1.0, 8, 1.0)[0].double(), -1)[c])
        if 0.1 < p < 0.9:
            return [5, 9, c, 5, 9]
    raise AssertionError("no prompt makes prompt lookup's guess uncertain")


WIDE_CASES = {  # case -> the mutant builds that must fail its law (the point mass keeps its guess; residual + 1% p)
    "draft-model-chain": ("mutant_block", "mutant_residual"),
    "lookup-chain": ("mutant_block", "mutant_point_mass"),
}


@pytest.mark.parametrize(
    ("name", "variant"), [(name, variant) for name, mutants in WIDE_CASES.items() for variant in ("native", *mutants)]
)
def test_laws_across_several_blocks_through_the_compiled_ops(wide_target, name, variant, monkeypatch):
    """Proves the compiled chain rule and draws keep the target's law at a vocabulary of 150 (three 64-entry blocks,
    the last one partial; T 1, top-k 8): a draft model's sampled chain (γ 2, first token) and prompt lookup's
    point-mass chain (γ 2, first two tokens), enumerated through exact_chain and inverse_cdf_rows, to 1e-6, with mass
    on the last block's tokens. Controls: the build whose draws never reach the last block, and the one that fault
    each chain's residual (max(0, p − q) + 1% p; the guess left in p) — each must miss by ≥ 100× the bound."""
    use_build(variant, monkeypatch)
    if name == "draft-model-chain":
        draft = sd.load_model(perturbed(wide_target.model, seed=4, noise=0.15))
        decoder, prompt = sd.SpeculativeDecoder(wide_target, sd.DraftModelProposer(draft), gamma=2), [5, 9, 11]
    else:
        decoder, prompt = (
            sd.SpeculativeDecoder(wide_target, sd.PromptLookupProposer(), gamma=2),
            lookup_prompt(wide_target),
        )
    tokens = 1 if name == "draft-model-chain" else 2  # a sampled chain's second token: thousands of runs
    result = kernel_law(decoder, prompt, TOP8, tokens=tokens)
    reference = prefix_law(wide_target, prompt, TOP8, tokens=tokens)
    tv = total_variation(result.law, reference)
    if variant == "native":
        assert any(token >= 128 for outcome in reference for token in outcome), "no mass on the last block"
        assert result.accepted_mass > 0.05 and result.runs > 8, result
        assert tv < BOUND, (name, tv, result.runs)
    else:
        assert tv > 100 * BOUND, (name, variant, tv)
