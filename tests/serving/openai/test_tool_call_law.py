"""``tool_choice: "auto"`` is exact under speculation (issue 66): the law of the output under the Hermes convention's
grammar (free text, or a ``<tool_call>`` whose name and arguments the grammar constrains once it opens), computed
exactly through the real engine (``enumeration.engine_law``) over the first two tokens, equals plain constrained
sampling's law in total variation to 1e-6, for a chain drafted by prompt lookup and a tree whose first guesses include
the opening marker; and a control that applies each row's mask one row late misses by ≥ 100× the bound. (A sampled
draft model's rule under a grammar: tests/structured/test_structured_law.py; enumerating it over this grammar's
free text takes minutes.)

The vocabulary is 16 pieces of a Hermes answer (text "x" and "y", the markers, the call's JSON pieces) and the target's
law is flat, so that the first token already branches between text and a call, and the row after a drafted marker
allows only the newline."""

from __future__ import annotations

import pytest
import torch
from helpers.enumeration import BOUND, guided_tables
from helpers.laws import plain_law
from helpers.models import tiny_llama, with_eos
from helpers.structured import mask_one_row_late, piece_tokenizer
from helpers.trees import TreeProposer

import specdecode as sd
import specdecode.engine.request
from specdecode.exactness.check import target_law
from specdecode.exactness.enumeration import engine_law, prefix_law, total_variation
from specdecode.serving.openai.tool_calls import HERMES, call_grammar
from specdecode.structured import Constraint

PIECES = ["<eos>", "x", "y", "<tool_call>", "</tool_call>", "\n", '{"name": "', "f", "g", '", "arguments": ']
PIECES += ["{", "}", '"', "a", ":", "1"]
FUNCTIONS = {
    "f": {"type": "object", "properties": {}, "additionalProperties": False},
    "g": {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"], "additionalProperties": False},
}
PROMPT = [2, 1, 3, 5, 6, 7, 9, 2, 1]  # "y x <tool_call> \n {"name": " f ..." then "y x": lookup drafts the call
TOKENS = 2  # the law of the first two tokens: text, or a call opening (its marker, then only the newline)


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    model = tiny_llama(len(PIECES), seed=0, logit_scale=1.0)  # a flat law: calls and text both likely
    return with_eos(sd.load_model(model, tokenizer=piece_tokenizer(PIECES)), 0)


@pytest.fixture(scope="module")
def grammar(target) -> sd.Grammar:
    return call_grammar(HERMES, FUNCTIONS, target.tokenizer, auto=True, parallel=True, strict=False, compact=True)


def ended(law: dict) -> dict:
    """``law`` with every sequence cut after its first EOS (id 0: the output ends there), masses merged."""
    out: dict = {}
    for sequence, mass in law.items():
        cut = sequence[: sequence.index(0) + 1] if 0 in sequence else sequence
        out[cut] = out.get(cut, 0.0) + mass
    return out


def constrained_law(target: sd.LoadedModel, prompt: list[int], params: sd.SamplingParams, tokens: int) -> dict:
    """Plain constrained sampling's law of the first ``tokens`` tokens (each prefix's target law under the mask of
    the grammar's state after that prefix), sequences cut at the EOS."""

    def step_law(logits: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
        constraint = Constraint(params.grammar, target.tokenizer, target.vocab_size, target.eos_token_ids)
        constraint.advance(list(prefix))
        return target_law(logits.masked_fill(~constraint.mask(), float("-inf")), params)

    return ended(plain_law(target, prompt, tokens, step_law))


def case(name: str, target: sd.LoadedModel, grammar: sd.Grammar):
    params = sd.SamplingParams(temperature=1.0, max_new_tokens=4, grammar=grammar)
    if name == "chain/lookup":
        return sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=3), params
    tables = guided_tables(target, 2, 1)
    tables[0, :, 3] += 1.0  # the first guesses include the opening marker: rows after it are verified
    proposer = TreeProposer((3, 2), tables / tables.sum(-1, keepdim=True), sampled=False)
    return sd.SpeculativeDecoder(target, proposer, gamma=2), params


@pytest.mark.parametrize("name", ["chain/lookup", "tree/point-mass"])
def test_auto_tool_calls_keep_the_constrained_law_under_speculation(target, grammar, name):
    decoder, params = case(name, target, grammar)
    result = engine_law(decoder, PROMPT, params, tokens=TOKENS)
    reference = constrained_law(target, PROMPT, params, tokens=TOKENS)
    assert total_variation(result.law, reference) < BOUND, (name, result.runs)
    assert result.runs > 1 and result.accepted_mass > 0.01, (result.runs, result.accepted_mass)
    opened = sum(p for seq, p in reference.items() if seq[0] == 3)
    assert 0.005 < opened < 0.99, opened  # both text and calls carry mass: the law covers both branches
    free = sd.SamplingParams(temperature=params.temperature)
    assert total_variation(ended(prefix_law(target, PROMPT, free, tokens=TOKENS)), reference) > 0.005  # the mask shows


@pytest.mark.parametrize("name", ["chain/lookup", "tree/point-mass"])
def test_a_mask_applied_one_row_late_is_caught(target, grammar, name, monkeypatch):
    decoder, params = case(name, target, grammar)
    reference = constrained_law(target, PROMPT, params, tokens=TOKENS)
    mask_one_row_late(monkeypatch)
    tv = total_variation(engine_law(decoder, PROMPT, params, tokens=TOKENS).law, reference)
    assert tv > 100 * BOUND, (name, tv)
