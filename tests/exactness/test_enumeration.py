"""The engine's law computed exactly (``enumeration.engine_law``: every random decision enumerated through the real
engine) against the target's own (``prefix_law``): total variation below 1e-6 for every point-mass law — chains and
trees of prompt lookup, suffix trees, deterministic deep + wide trees to depth 3, under warped sampling — where the
sampled tests detect TV ≈ 0.1 (CI) or 0.02 (the strong tier). The float32 softmax of the engine's target probs
leaves ~1e-8; a bias of 1e-4 would be 100× over the bound. The minimally biased controls (every residual mixed 1%
with the target's own law, TV ≈ 1e-3) must exceed it, and do. Sampled drafts (a draft model, sampled siblings)
multiply the runs by V per guess: those run in the slow suite.
"""

from __future__ import annotations

import pytest
import torch
from helpers.enumeration import (
    BOUND,
    LOOKUP_PROMPT,
    MIXED,
    T1,
    case,
    guided_tables,
)
from helpers.kernels import use_build
from helpers.models import SMALL_VOCAB, perturbed, tiny_llama
from helpers.trees import TreeProposer

import specdecode as sd
import specdecode.sampling.verify
from specdecode.exactness.enumeration import Enumerator, engine_law, prefix_law, total_variation

WARPED = {
    "T1": T1,
    "T0.8-topk4": sd.SamplingParams(temperature=0.8, top_k=4, max_new_tokens=4),
    "T0.9-topp0.9": sd.SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=4),
}


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return sd.load_model(tiny_llama(SMALL_VOCAB, seed=0))


POINT_MASS = ("chain/lookup", "tree/lookup-3-branches", "tree/deep-wide-3-2", "tree/depth-3", "tree/suffix")


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("warp", list(WARPED))
@pytest.mark.parametrize("name", POINT_MASS)
def test_point_mass_laws_are_the_targets_exactly(target, name, warp, path, monkeypatch):
    """Every point-mass law, on the torch verification path and through the compiled ops a float32 CPU request runs
    (``through_kernels``: the chain rule is ``exact_chain``, every draw ``inverse_cdf_rows``)."""
    params = WARPED[warp]
    if path == "kernels":
        use_build("native", monkeypatch)
    decoder, prompt = case(name, target)
    result = engine_law(decoder, prompt, params, tokens=2, through_kernels=path == "kernels")
    assert sum(result.law.values()) == pytest.approx(1.0, abs=1e-12)
    tv = total_variation(result.law, prefix_law(target, prompt, params, tokens=2))
    assert tv < BOUND, (name, warp, tv, result.runs)
    assert result.runs > 1  # the decisions were enumerated, not one path
    assert result.accepted_mass > 0.05, result.accepted_mass  # the law went through verification


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("name", ["chain/lookup", "tree/lookup-3-branches", "tree/deep-wide-3-2"])
def test_a_residual_biased_by_one_percent_is_caught(target, name, path, monkeypatch):
    """Every residual mixed 1% with p (``verify._residual``: the torch path, and the tree rules on either path);
    through the compiled ops a chain's residual is ``exact_chain``'s, so there the control is the build whose
    point-mass residual keeps the guess (kernels.MUTANTS). Each must miss by ≥ 100× the bound."""
    compiled = path == "kernels" and name.startswith("chain")
    if path == "kernels":
        use_build("mutant_point_mass" if compiled else "native", monkeypatch)
    decoder, prompt = case(name, target)
    reference = prefix_law(target, prompt, T1, tokens=2)
    correct = specdecode.sampling.verify._residual

    def mixed(target_probs, draft, token):
        residual = correct(target_probs, draft, token)
        return (1 - MIXED) * residual / residual.sum() + MIXED * target_probs / target_probs.sum()

    if not compiled:
        monkeypatch.setattr(specdecode.sampling.verify, "_residual", mixed)
    tv = total_variation(engine_law(decoder, prompt, T1, tokens=2, through_kernels=path == "kernels").law, reference)
    assert tv > 100 * BOUND, (name, tv)


def test_the_enumerator_gives_the_chain_rule_its_exact_law():
    """speculative_sample alone, its guesses drawn from q, every decision enumerated: the first token's law is p
    to 1e-15, and the first guess is accepted with probability Σ min(p, q)."""
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(2 * torch.randn(3, 6, generator=generator, dtype=torch.float64), -1)
    draft_probs = torch.softmax(2 * torch.randn(2, 6, generator=generator, dtype=torch.float64), -1)
    first = torch.zeros(6, dtype=torch.float64)
    accepted_first = 0.0
    scripts: list[list[tuple[int, int]]] = [[]]
    while scripts:
        script = scripts.pop()
        choices = Enumerator(script, wanted=99, eos=())
        guesses = torch.tensor([choices.draw(draft_probs[i], emitted=False) for i in range(2)])
        n, token = sd.verify.speculative_sample(target_probs, draft_probs, guesses, choices)
        first[int(guesses[0]) if n > 0 else token] += choices.weight
        accepted_first += choices.weight if n > 0 else 0.0
        for position in range(len(script), len(choices.taken)):
            count = choices.taken[position][1]
            scripts.extend([*choices.taken[:position], (b, count)] for b in range(1, count))
    torch.testing.assert_close(first, target_probs[0], atol=1e-15, rtol=0)
    assert accepted_first == pytest.approx(float(torch.minimum(target_probs[0], draft_probs[0]).sum()), abs=1e-15)


def test_engine_law_refuses_what_it_cannot_enumerate(target):
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma="auto")
    with pytest.raises(ValueError, match="fixed gamma"):
        engine_law(decoder, LOOKUP_PROMPT, T1)
    with pytest.raises(ValueError, match="exact mode"):
        engine_law(sd.SpeculativeDecoder(target, mode="reproducible"), LOOKUP_PROMPT, T1)


# --- slow: more decisions ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_depth_3_tree_gives_the_targets_law_of_three_tokens(target):
    decoder, prompt = case("tree/depth-3", target)
    result = engine_law(decoder, prompt, T1, tokens=3)
    assert total_variation(result.law, prefix_law(target, prompt, T1, tokens=3)) < BOUND and result.runs > 1000


class MisstatedDraftModel(sd.DraftModelProposer):
    """WRONG (the control): guesses drawn from the draft's law q, verified against 0.97 q + 0.03 uniform."""

    def propose(self, context, k, params, generator):
        draft = super().propose(context, k, params, generator)
        misstated = None if draft.probs is None else 0.97 * draft.probs + 0.03 / draft.probs.shape[-1]
        return sd.Draft(draft.tokens, misstated, draft.parents)


@pytest.mark.slow
@pytest.mark.parametrize("sampled", ["draft-model", "sampled-star", "misstated-draft-model-control"])
def test_sampled_drafts_give_the_targets_law(target, sampled):
    """Sampled guesses (a draft model's chain; siblings drawn without replacement) enumerated too: V branches
    per guess, thousands of runs. The control, a draft model misstating its law by 3%, must miss it."""
    if sampled == "sampled-star":
        proposer = TreeProposer((2,), guided_tables(target, 1, 3), sampled=True)
        decoder, prompt, tokens = sd.SpeculativeDecoder(target, proposer, gamma=1), [1, 2, 3], 1
    else:
        kind = sd.DraftModelProposer if sampled == "draft-model" else MisstatedDraftModel
        proposer = kind(sd.load_model(perturbed(target.model, seed=1, noise=0.15)))
        decoder, prompt, tokens = sd.SpeculativeDecoder(target, proposer, gamma=1), LOOKUP_PROMPT, 2
    result = engine_law(decoder, prompt, T1, tokens=tokens)
    tv = total_variation(result.law, prefix_law(target, prompt, T1, tokens=tokens))
    assert result.runs > 200 and result.accepted_mass > 0.05
    if sampled.endswith("control"):
        assert tv > 100 * BOUND, tv
    else:
        assert tv < BOUND, tv
