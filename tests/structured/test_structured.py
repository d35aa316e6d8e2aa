"""Structured output on a tiny model with a JSON vocabulary (issue 55): every generated object valid under its schema
(``jsonschema``), greedy identity with and without speculation, reproducible mode equal to plain sampling, forced
tokens counted apart, and one-line errors for bad grammars."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch
from helpers.models import perturbed, tiny_llama, with_eos
from helpers.structured import PIECES, SCHEMAS, char_tokenizer, json_tokenizer

import specdecode as sd
from specdecode.structured import Constraint

PIECES += ["o", "-", ".", "true", "false", "null", '"name"', '"tags"', '"age"', "ab", "ba", "x", "k", "u", "l", "r"]
PIECES += ["f", "5"]


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return with_eos(sd.load_model(tiny_llama(len(PIECES), seed=0), tokenizer=json_tokenizer()), 0)


@pytest.fixture(scope="module")
def draft(target) -> sd.LoadedModel:
    return sd.load_model(perturbed(tiny_llama(len(PIECES), seed=0), seed=1, noise=0.3), tokenizer=target.tokenizer)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_generated_objects_are_valid_under_their_schema(target, draft, index):
    """Five seeds, speculative and plain: ten objects a schema, 100 in all, each ended by EOS and valid."""
    schema = SCHEMAS[index]
    grammar = sd.Grammar.json_schema(schema)
    decoder = sd.SpeculativeDecoder(target, sd.DraftModelProposer(draft), gamma=3)
    for seed in range(5):
        params = sd.SamplingParams(temperature=1.0, max_new_tokens=60, seed=seed, grammar=grammar)
        for out in (decoder.generate([1, 2, 3], params), sd.autoregressive_generate(target, [1, 2, 3], params)):
            assert out.finish_reason == "eos", (out.text, out.finish_reason)
            jsonschema.validate(json.loads(out.text), schema)


def test_greedy_and_reproducible_outputs_equal_plain_decodings(target, draft):
    grammar = sd.Grammar.json_schema(SCHEMAS[3])
    for temperature in (0.0, 1.0):
        params = sd.SamplingParams(temperature=temperature, max_new_tokens=40, seed=5, grammar=grammar)
        plain = sd.autoregressive_generate(target, [1, 2, 3], params)
        mode = "exact" if temperature == 0 else "reproducible"
        for proposer in (sd.DraftModelProposer(draft), sd.PromptLookupProposer()):
            out = sd.SpeculativeDecoder(target, proposer, gamma=3, mode=mode).generate([1, 2, 3], params)
            assert out.token_ids == plain.token_ids, (temperature, out.text, plain.text)
            assert out.stats.forced > 0  # "{" opens every object: forced, drafted for free
            assert out.stats.accepted <= out.stats.drafted


@pytest.mark.parametrize("proposer", ["draft-model", "lookup"])
def test_greedy_identity_when_the_grammar_completes_before_the_budget(target, draft, proposer):
    """Schema 0 ends after ``{"ok":true}`` or ``{"ok":false}``, the closing brace and EOS forced: the round after the
    boolean forces them (the regression: its matcher bookkeeping ended the output one token early)."""
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=40, grammar=sd.Grammar.json_schema(SCHEMAS[0]))
    plain = sd.autoregressive_generate(target, [1, 2, 3], params)
    chosen = sd.DraftModelProposer(draft) if proposer == "draft-model" else sd.PromptLookupProposer()
    out = sd.SpeculativeDecoder(target, chosen, gamma=3).generate([1, 2, 3], params)
    assert plain.finish_reason == "eos" and json.loads(plain.text) in ({"ok": True}, {"ok": False})
    assert out.token_ids == plain.token_ids, (out.text, plain.text)
    assert out.stats.forced <= len(out.token_ids)


def test_the_matcher_is_where_it_was_after_forcing_and_masking_past_the_grammars_end(target):
    """``forced`` and ``chain_masks`` look past the grammar's end (llguidance stops after ``}``; an EOS there is a
    no-op it does not record): afterwards the matcher allows what it allowed before, and rollback undoes tokens."""
    eos, close = PIECES.index("<eos>"), PIECES.index("}")
    constraint = Constraint(sd.Grammar.json_schema(SCHEMAS[0]), target.tokenizer, target.vocab_size, [eos])
    constraint.advance([PIECES.index(piece) for piece in ["{", '"', "o", "k", '"', ":", "true"]])
    before = constraint.mask()
    assert before.nonzero().flatten().tolist() == [close]
    assert constraint.forced(32) == [close]  # nothing is forced past the output's end
    assert torch.equal(constraint.mask(), before)
    allowed, n = constraint.chain_masks([close, eos, eos, eos])
    assert n == 4 and torch.equal(allowed[0], before) and torch.equal(constraint.mask(), before)
    assert constraint.advance([close, eos, eos]) == 3
    constraint.rollback(3)  # as Request.emit does when the sink keeps none of them
    assert torch.equal(constraint.mask(), before)


def test_penalties_and_logit_bias_apply_under_the_grammar_identically(target, draft):
    """Warps that read each row's context (penalties) and logit_bias come before the grammar's mask: a bias towards a
    token the grammar forbids changes nothing it forbids, and speculative output equals plain under both."""
    schema = SCHEMAS[9]
    bias = {PIECES.index("}"): 100.0}  # allowed inside a string only
    for temperature in (0.0, 1.0):
        params = sd.SamplingParams(
            temperature=temperature,
            max_new_tokens=60,
            seed=2,
            grammar=sd.Grammar.json_schema(schema),
            frequency_penalty=1.5,
            repetition_penalty=1.3,
            logit_bias=bias,
        )
        plain = sd.autoregressive_generate(target, [1, 2, 3], params)
        mode = "exact" if temperature == 0 else "reproducible"
        out = sd.SpeculativeDecoder(target, sd.DraftModelProposer(draft), gamma=3, mode=mode).generate(
            [1, 2, 3], params
        )
        assert out.token_ids == plain.token_ids, (out.text, plain.text)
        assert plain.finish_reason == "eos" and '"}}}"' in plain.text  # biased where allowed, masked elsewhere
        jsonschema.validate(json.loads(plain.text), schema)
        unbiased = sd.autoregressive_generate(target, [1, 2, 3], dataclasses.replace(params, logit_bias={}))
        assert unbiased.token_ids != plain.token_ids


def test_without_the_grammar_the_tiny_model_writes_no_json(target):
    out = sd.autoregressive_generate(target, [1, 2, 3], sd.SamplingParams(temperature=1.0, max_new_tokens=30, seed=0))
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize(
    "build",
    [
        lambda: sd.Grammar.regex("a(b"),
        lambda: sd.Grammar.json_schema("{not json"),
        lambda: sd.Grammar.json_schema({"type": "string", "format": "no-such-format"}),
        lambda: sd.Grammar("xml", ""),
        lambda: sd.SamplingParams(grammar='{"type": "object"}'),
    ],
)
def test_bad_grammars_raise_one_line_errors(build):
    with pytest.raises(ValueError) as error:
        build()
    assert "\n" not in str(error.value)


def test_a_lenient_schema_ignores_unknown_formats():
    sd.Grammar.json_schema({"type": "string", "format": "no-such-format"}, strict=False)


def test_json_is_compact_by_default_and_flexible_on_request():
    """Compact JSON (OpenAI's: no whitespace) takes only ``,`` and ``:`` between tokens; flexible JSON also takes
    bounded whitespace there (a newline and indentation, as pretty-printed JSON has)."""
    tokenizer = char_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}}

    def accepts(grammar: sd.Grammar, text: str) -> bool:
        constraint = Constraint(grammar, tokenizer, len(tokenizer), [0])
        tokens = [*tokenizer.encode(text, add_special_tokens=False), 0]
        return all(bool(constraint.mask()[t]) and constraint.consume(t) for t in tokens)

    compact, pretty = '{"a":1,"b":[2,3]}', '{\n    "a": 1,\n    "b": [2, 3]\n}'
    for build in (lambda **c: sd.Grammar.json_schema(schema, **c), lambda **c: sd.Grammar.json_object(**c)):
        assert build().compact and accepts(build(), compact) and not accepts(build(), pretty)
        assert accepts(build(compact=False), compact) and accepts(build(compact=False), pretty)
    assert not accepts(sd.Grammar.json_object(compact=False), "{" + " " * 25 + '"a":1}')  # whitespace is bounded
