"""Structured output on a tiny model with a JSON vocabulary (issue 55): every generated object valid under its schema
(``jsonschema``), greedy identity with and without speculation, reproducible mode equal to plain sampling, forced
tokens counted apart, and one-line errors for bad grammars."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.models import perturbed, tiny_llama, with_eos
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import specdecode as sd

# No whitespace pieces: the output is compact JSON, so a random model cannot spend its budget on blanks.
PIECES = ["<eos>", "{", "}", "[", "]", '"', ":", ",", "a", "b", "c", "n", "e", "m", "g", "s", "t", "0", "1", "2"]
PIECES += ["o", "-", ".", "true", "false", "null", '"name"', '"tags"', '"age"', "ab", "ba", "x", "k"]
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 4},
]


def json_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(PIECES)}, unk_token=PIECES[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()  # text = the pieces joined
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=PIECES[0], eos_token="<eos>")


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return with_eos(sd.load_model(tiny_llama(len(PIECES), seed=0), tokenizer=json_tokenizer()), 0)


@pytest.fixture(scope="module")
def draft(target) -> sd.LoadedModel:
    return sd.load_model(perturbed(tiny_llama(len(PIECES), seed=0), seed=1, noise=0.3), tokenizer=target.tokenizer)


@pytest.mark.xfail(strict=True, reason="open bug: a speculative run emitted EOS before the object's closing brace")
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_generated_objects_are_valid_under_their_schema(target, draft, index):
    schema = SCHEMAS[index]
    grammar = sd.Grammar.json_schema(schema)
    decoder = sd.SpeculativeDecoder(target, sd.DraftModelProposer(draft), gamma=3)
    for seed in range(4):
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
