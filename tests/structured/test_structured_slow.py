"""Structured output on the bundled SmolLM2 (issue 55; slow): 100 objects sampled speculatively across ten schemas,
each ended by EOS and valid under its schema (``jsonschema``), and greedy output under each schema identical with
and without speculation (the real tokenizer's forced tokens, whitespace and multi-token keys)."""

from __future__ import annotations

import json

import jsonschema
import pytest

import specdecode as sd

pytestmark = pytest.mark.slow

STRING = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": STRING, "born": {"type": "integer", "minimum": 1800, "maximum": 2020}},
        "required": ["name", "born"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 5},
    {"enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {"title": STRING, "year": {"type": "integer"}, "genre": {"enum": ["novel", "poem", "essay"]}},
        "required": ["title", "genre"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": STRING,
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}, "in_stock": {"type": "boolean"}},
        "required": ["price", "in_stock"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ok": {"type": "boolean"}},
        "required": ["code", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 8}}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    {"anyOf": [{"type": "null"}, {"type": "string", "minLength": 1, "maxLength": 10}]},
]
for schema in SCHEMAS:  # bounded: every valid output is short
    if schema.get("type") == "array":
        schema.setdefault("maxItems", 3)
    if schema.get("type") == "object" and "tags" in schema["properties"]:
        schema["properties"]["tags"]["maxItems"] = 3


@pytest.fixture(scope="module")
def smollm2() -> sd.LoadedModel:
    return sd.load_model("smollm2")


def prompt(target: sd.LoadedModel, schema: dict) -> list[int]:
    return target.chat_prompt(f"Reply with one JSON value valid under this JSON schema: {json.dumps(schema)}")


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_sampled_objects_are_valid_and_greedy_equals_plain(smollm2, index):
    schema, ids = SCHEMAS[index], prompt(smollm2, SCHEMAS[index])
    grammar = sd.Grammar.json_schema(schema)
    decoder = sd.SpeculativeDecoder(smollm2, sd.PromptLookupProposer(), gamma=4)
    for seed in range(10):
        params = sd.SamplingParams(temperature=1.0, max_new_tokens=160, seed=seed, grammar=grammar)
        out = decoder.generate(ids, params)
        assert out.finish_reason == "eos", (out.text, out.finish_reason)
        jsonschema.validate(json.loads(out.text), schema)
    greedy = sd.SamplingParams(temperature=0.0, max_new_tokens=160, grammar=grammar)
    plain = sd.autoregressive_generate(smollm2, ids, greedy)
    assert decoder.generate(ids, greedy).token_ids == plain.token_ids
    jsonschema.validate(json.loads(plain.text), schema)
