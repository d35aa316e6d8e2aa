"""``response_format`` over HTTP (issue 55), on the tiny model over JSON pieces (tests/structured/test_structured.py):
each shape (``json_object``, ``json_schema`` with ``strict``, the ``regex`` and ``grammar`` extensions, ``text``) gives
the library's own constrained output, speculating or not, whole or streamed, n choices each valid; a bad one is a 400
naming ``response_format``; and the ``openai`` client's ``response_format`` and ``parse`` paths."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from helpers.models import tiny_llama, with_eos
from helpers.serving import PATHS, body_for, events, serve
from helpers.structured import PIECES, SCHEMAS, json_tokenizer
from helpers.tokenizers import CHAT_TEMPLATE

import specdecode as sd
from specdecode.serving.openai.responses import choice_seed

PROMPT = "{ [ a"
SCHEMA = SCHEMAS[5]  # {"name": "ab" | "ba" | "cab", "age": 1 | 2 | null}
FORMATS = {
    "json_object": ({"type": "json_object"}, sd.Grammar.json_object()),
    "json_schema": (
        {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}},
        sd.Grammar.json_schema(SCHEMA),
    ),
    "regex": ({"type": "regex", "regex": "(ab|ba){1,3}"}, sd.Grammar.regex("(ab|ba){1,3}")),
    "lark": (
        {"type": "grammar", "syntax": "lark", "grammar": 'start: "[" ("a" | "b")+ "]"'},
        sd.Grammar.lark('start: "[" ("a" | "b")+ "]"'),
    ),
}


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    tokenizer = json_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return with_eos(sd.load_model(tiny_llama(len(PIECES), seed=0), tokenizer=tokenizer, backend="native"), 0)


@pytest.fixture(scope="module")
def server(target):
    with serve(target) as running:  # reproducible mode
        yield running


def prompt_ids(target: sd.LoadedModel, route: str) -> list[int]:
    if route == "chat":
        return target.chat_prompt(PROMPT)
    return target.encode(PROMPT)


def library(target, route: str, grammar, seed: int, index: int = 0, tokens: int = 40) -> sd.GenerationOutput:
    params = sd.SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=choice_seed(seed, index), grammar=grammar)
    return sd.autoregressive_generate(target, prompt_ids(target, route), params)


def text_of(route: str, choice: dict) -> str:
    return choice["message"]["content"] if route == "chat" else choice["text"]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_each_response_format_gives_the_librarys_constrained_output(http, target, route, name):
    response_format, grammar = FORMATS[name]
    expected = library(target, route, grammar, seed=4)
    reason = "stop" if expected.finish_reason == "eos" else "length"  # any JSON object: it may run past 40 tokens
    assert reason == "stop" or name == "json_object"
    for speculative in (True, False):
        body = body_for(route, PROMPT, max_tokens=40, temperature=1.0, seed=4, speculative=speculative)
        data = http.post(PATHS[route], json={**body, "response_format": response_format}).json()
        choice = data["choices"][0]
        assert text_of(route, choice) == expected.text and choice["finish_reason"] == reason, (speculative, data)
    if name == "json_schema":
        jsonschema.validate(json.loads(expected.text), SCHEMA)
    if name == "json_object" and reason == "stop":
        assert isinstance(json.loads(expected.text), dict)
    if name == "json_object":
        assert expected.text.startswith("{")
    unconstrained = http.post(PATHS[route], json=body_for(route, PROMPT, max_tokens=40, temperature=1.0, seed=4))
    assert text_of(route, unconstrained.json()["choices"][0]) != expected.text


def test_streamed_and_n_choices_each_follow_the_schema(http, target):
    response_format, grammar = FORMATS["json_schema"]
    body = body_for("chat", PROMPT, max_tokens=40, temperature=1.0, seed=8, n=3, response_format=response_format)
    whole = http.post(PATHS["chat"], json=body).json()["choices"]
    streamed = ["", "", ""]
    for event in events(http.post(PATHS["chat"], json={**body, "stream": True}).text):
        if event != "[DONE]":
            for choice in json.loads(event)["choices"]:
                streamed[choice["index"]] += choice["delta"].get("content") or ""
    for index, choice in enumerate(whole):
        expected = library(target, "chat", grammar, seed=8, index=index).text
        assert choice["message"]["content"] == streamed[index] == expected
        jsonschema.validate(json.loads(expected), SCHEMA)


def test_text_format_and_null_are_free_text(http):
    body = body_for("completions", PROMPT, max_tokens=12, temperature=1.0, seed=2)
    free = http.post(PATHS["completions"], json=body).json()["choices"][0]["text"]
    for response_format in ({"type": "text"}, None):
        got = http.post(PATHS["completions"], json={**body, "response_format": response_format}).json()
        assert got["choices"][0]["text"] == free


def test_a_lenient_schema_ignores_what_a_strict_one_refuses(http):
    schema = {"type": "string", "format": "no-such-format", "maxLength": 3}
    body = body_for("chat", PROMPT, max_tokens=20, temperature=1.0, seed=1)
    for strict, status in ((True, 400), (False, 200), (None, 200)):
        spec = {"name": "s", "schema": schema} | ({} if strict is None else {"strict": strict})
        response = http.post(
            PATHS["chat"], json={**body, "response_format": {"type": "json_schema", "json_schema": spec}}
        )
        assert response.status_code == status, response.text
        if status == 200:
            assert isinstance(json.loads(response.json()["choices"][0]["message"]["content"]), str)


BAD = [
    ({"type": "xml"}, "type"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": ["no"]}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}, "strict": True}}, "nope"),
    ({"type": "json_object", "schema": {}}, "schema"),
    ({"type": "regex", "regex": "a(b"}, "regex"),
    ({"type": "grammar", "syntax": "ebnf", "grammar": "x"}, "syntax"),
    ({"type": "grammar", "syntax": "gbnf", "grammar": 'root ::= "a'}, "gbnf"),
    ("json", "response_format"),
]


@pytest.mark.parametrize(("response_format", "words"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_response_format_is_a_400_naming_it(http, response_format, words):
    for route in ("chat", "completions"):
        body = {**body_for(route, PROMPT, max_tokens=4), "response_format": response_format}
        response = http.post(PATHS[route], json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format" and words in error["message"], error
        assert "\n" not in error["message"]


class Record(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=4)
    age: int = pydantic.Field(ge=0, le=99)


def test_the_openai_client_gets_json_and_parsed_objects(server, target):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    response_format, grammar = FORMATS["json_schema"]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, temperature=1.0, seed=4, response_format=response_format
    )
    assert chat.choices[0].message.content == library(target, "chat", grammar, seed=4).text
    parsed = client.chat.completions.parse(
        model="tiny", messages=messages, max_tokens=60, temperature=1.0, seed=3, response_format=Record
    )
    record = parsed.choices[0].message.parsed
    assert isinstance(record, Record) and len(record.name) <= 4 and 0 <= record.age <= 99
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model="tiny", messages=messages, response_format={"type": "json_schema", "json_schema": {"name": "x"}}
        )


def test_json_whitespace_flexible_is_the_flexible_grammar_and_a_cut_object_says_length(http, target):
    """``json_whitespace: "flexible"`` asks for the grammar with bounded whitespace (the tiny vocabulary has no
    blanks, so its text is compact's here: the request is checked against the library's output under the flexible
    grammar); a JSON answer cut by max_tokens ends with ``finish_reason: "length"``."""
    schema = SCHEMAS[2]  # {"age": 0..99}: letters and digits the vocabulary spells
    response_format = {"type": "json_schema", "json_schema": {"name": "age", "schema": schema}}
    expected = library(target, "chat", sd.Grammar.json_schema(schema, strict=False, compact=False), seed=3)
    body = body_for("chat", PROMPT, max_tokens=40, temperature=1.0, seed=3, response_format=response_format)
    got = http.post(PATHS["chat"], json={**body, "json_whitespace": "flexible"}).json()["choices"][0]
    assert got["message"]["content"] == expected.text and got["finish_reason"] == "stop"
    jsonschema.validate(json.loads(expected.text), schema)
    cut = http.post(PATHS["chat"], json={**body, "max_tokens": 3}).json()["choices"][0]
    assert cut["finish_reason"] == "length" and expected.text.startswith(cut["message"]["content"])
    bad = http.post(PATHS["chat"], json={**body, "json_whitespace": "pretty"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "json_whitespace", bad.text
