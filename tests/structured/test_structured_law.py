"""The output law under a grammar (issue 55), computed exactly: every random decision enumerated through the real
engine (``enumeration.engine_law``) and compared in total variation with plain constrained sampling's law (each
prefix's target law under the grammar's mask, ``constrained_law``), bound 1e-6 as in
tests/exactness/test_enumeration.py; and a control that applies each row's mask one row late, which must miss by ≥ 100×
the bound.

The grammar is a regex over a vocabulary of 16 letters "a".."p" (llguidance needs one-character tokens) whose mask
depends on the previous token (after a-f only k-p may follow), so a row's mask is right only under the drafted prefix
before it; the prompts make the proposers draft forbidden tokens too (cut after them, rejected by every rule).
"""

from __future__ import annotations

import pytest
import torch
from helpers.enumeration import BOUND, LOOKUP_PROMPT, guided_tables
from helpers.kernels import use_build
from helpers.laws import plain_law
from helpers.models import SMALL_VOCAB, perturbed, tiny_llama
from helpers.structured import mask_one_row_late
from helpers.tokenizers import word_tokenizer
from helpers.trees import TreeProposer

import specdecode as sd
import specdecode.engine.request
from specdecode.exactness.check import target_law
from specdecode.exactness.enumeration import engine_law, prefix_law, total_variation
from specdecode.structured import Constraint

LETTERS = [chr(ord("a") + i) for i in range(SMALL_VOCAB)]
GRAMMAR = sd.Grammar.regex("([a-f][k-p]|[g-j])+")
PARAMS = sd.SamplingParams(temperature=1.0, max_new_tokens=4, grammar=GRAMMAR)
SAMPLED = sd.SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4, grammar=GRAMMAR)


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return sd.load_model(tiny_llama(SMALL_VOCAB, seed=0), tokenizer=word_tokenizer(LETTERS))


def constrained_law(target: sd.LoadedModel, prompt: list[int], params: sd.SamplingParams, tokens: int) -> dict:
    """Plain constrained sampling's law of the first ``tokens`` tokens: per prefix, the target's law (``params``'
    warps) of the logits masked by the grammar's state after that prefix."""

    def step_law(logits: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
        constraint = Constraint(params.grammar, target.tokenizer, target.vocab_size, target.eos_token_ids)
        constraint.advance(list(prefix))
        return target_law(logits.masked_fill(~constraint.mask(), float("-inf")), params)

    return plain_law(target, prompt, tokens, step_law)


def case(name: str, target: sd.LoadedModel) -> tuple[sd.SpeculativeDecoder, list[int], sd.SamplingParams]:
    if name == "chain/lookup":
        return sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=3), LOOKUP_PROMPT, PARAMS
    if name == "tree/point-mass":
        proposer = TreeProposer((3, 2), guided_tables(target, 2, 1), sampled=False)
        return sd.SpeculativeDecoder(target, proposer, gamma=2), [1, 2, 3], PARAMS
    model = sd.load_model(perturbed(tiny_llama(SMALL_VOCAB, seed=0), seed=1, noise=0.5), tokenizer=target.tokenizer)
    return sd.SpeculativeDecoder(target, sd.DraftModelProposer(model), gamma=2), [1, 2, 3], SAMPLED


CASES = ("chain/lookup", "tree/point-mass", "chain/draft-model")


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("name", CASES)
def test_the_law_under_a_grammar_is_plain_constrained_samplings(target, name, path, monkeypatch):
    """On the torch verification path and through the compiled ops a float32 CPU request runs."""
    if path == "kernels":
        use_build("native", monkeypatch)
    decoder, prompt, params = case(name, target)
    result = engine_law(decoder, prompt, params, tokens=3, through_kernels=path == "kernels")
    assert sum(result.law.values()) == pytest.approx(1.0, abs=1e-12)
    reference = constrained_law(target, prompt, params, tokens=3)
    tv = total_variation(result.law, reference)
    assert tv < BOUND, (name, tv, result.runs)
    assert result.runs > 1 and result.accepted_mass > 0.05, (result.runs, result.accepted_mass)
    free = sd.SamplingParams(temperature=params.temperature, top_k=params.top_k)
    assert (
        total_variation(prefix_law(target, prompt, free, tokens=3), reference) > 0.1
    )  # the grammar changes the law: the test can see it


@pytest.mark.parametrize("name", ["chain/lookup", "tree/point-mass"])
def test_a_mask_applied_one_row_late_is_caught(target, name, monkeypatch):
    decoder, prompt, params = case(name, target)
    reference = constrained_law(target, prompt, params, tokens=3)
    mask_one_row_late(monkeypatch)
    tv = total_variation(engine_law(decoder, prompt, params, tokens=3).law, reference)
    assert tv > 100 * BOUND, (name, tv)


FORCING = sd.Grammar.regex("([a-c]hi|[d-g])+")  # after a, b or c the grammar forces h, then i


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("control", [False, True], ids=["exact", "mask-one-row-late-control"])
@pytest.mark.parametrize("name", ["chain/lookup", "chain/draft-model"])
def test_the_law_with_forced_tokens_is_plain_constrained_samplings(target, name, control, path, monkeypatch):
    """Proves the law of three tokens when the grammar forces some (drafted for free at the head of the round,
    decoder.draft: ``Constraint.forced``) is plain constrained sampling's, to 1e-6, and that forced tokens led
    rounds. Control: each row's mask one row late (as above), which must miss by ≥ 100× the bound. On the torch
    verification path and through the compiled ops (the masks are torch code before either)."""
    if path == "kernels":
        use_build("native", monkeypatch)
    decoder, prompt, params = case(name, target)
    params = sd.SamplingParams(temperature=1.0, top_k=params.top_k, max_new_tokens=4, grammar=FORCING)
    reference = constrained_law(target, prompt, params, tokens=3)
    forced, real_forced = [], Constraint.forced

    def counted(self, limit):
        tokens = real_forced(self, limit)
        forced.append(len(tokens))
        return tokens

    monkeypatch.setattr(Constraint, "forced", counted)
    if control:
        mask_one_row_late(monkeypatch)
    law = engine_law(decoder, prompt, params, tokens=3, through_kernels=path == "kernels").law
    tv = total_variation(law, reference)
    assert max(forced) >= 2, forced  # rounds led by the forced h, i
    if control:
        assert tv > 100 * BOUND, (name, tv)
    else:
        assert tv < BOUND, (name, tv)
