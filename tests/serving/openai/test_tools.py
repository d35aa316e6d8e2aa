"""``tools`` over HTTP (issue 55), on the tiny JSON-pieces model (tests/structured/test_structured.py) with a chat
template that renders tools: a forced call (``tool_choice`` a named function or ``"required"``) is the library's output
under the call's grammar (greedy: identical with and without speculation; sampled: the same seed, the same call),
returned as OpenAI ``tool_calls`` whose arguments are valid under the function's schema; streamed, one ``tool_calls``
delta at the end; ``"none"`` is plain text without tools; refusals name their field (``auto``, a template without tool
support, an unknown function, a bad parameters schema); and the ``openai`` client's ``tools`` path."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from helpers.models import tiny_llama, with_eos
from helpers.serving import PATHS, events, serve
from helpers.structured import PIECES, SCHEMAS, piece_tokenizer
from helpers.tokenizers import CHAT_TEMPLATE

import specdecode as sd
from specdecode.serving.openai.tool_calls import BARE, HERMES, CallParser, call_grammar
from specdecode.structured import Constraint

# Renders each tool's name before the messages (as real templates render their schemas), and each earlier call's
# name and whether its arguments came as a mapping (transformers' convention)
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}{{ t['function']['name'] }} {% endfor %}{% for m in messages %}"
    "{% for c in m.tool_calls or [] %}{{ c['function']['name'] }} "
    "{{ 'ab' if c['function']['arguments'] is mapping else 'x x x' }} {% endfor %}"
    "{{ m['content'] }} {% endfor %}"
)
# The JSON pieces and the letters a call's keys need besides ("arguments"; "ok" and its booleans)
TOOL_PIECES = [*PIECES, "r", "u", "o", "k", "f", "l"]
PROMPT = "{ [ a"
MAX_TOKENS = 80
MESSAGES = [{"role": "user", "content": PROMPT}]
FUNCTIONS = {"ab": SCHEMAS[5], "ba": SCHEMAS[0]}  # {"name": enum, "age": enum} and {"ok": boolean}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": "d", "parameters": s}} for n, s in FUNCTIONS.items()
]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def model(template: str) -> sd.LoadedModel:
    tokenizer = piece_tokenizer(TOOL_PIECES)
    tokenizer.chat_template = template
    return with_eos(sd.load_model(tiny_llama(len(TOOL_PIECES), seed=0), tokenizer=tokenizer, backend="native"), 0)


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return model(TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def server(target):
    with serve(target) as running:
        yield running


def library(target, grammar, temperature: float, seed: int, tools=TOOLS) -> sd.GenerationOutput:
    """The library's output for the tool prompt (the template given ``tools``) under ``grammar``."""
    ids = target.tokenizer.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    params = sd.SamplingParams(temperature=temperature, max_new_tokens=MAX_TOKENS, seed=seed, grammar=grammar)
    return sd.autoregressive_generate(target, [int(t) for t in ids], params)


def forced(name: str) -> sd.Grammar:
    """The grammar of one call of ``name`` (the template has no known convention: bare JSON)."""
    return call_grammar(BARE, {name: FUNCTIONS[name]}, None, auto=False, parallel=False, strict=False, compact=True)


def post(http, **extra) -> httpx.Response:
    return http.post(PATHS["chat"], json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, **extra})


def the_call(choice: dict) -> dict:
    """The one tool call of a choice, its shape checked (OpenAI's)."""
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None, choice
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and set(call) == {"id", "type", "function"}
    assert isinstance(call["function"]["arguments"], str)
    return call["function"]


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_a_named_call_is_the_librarys_constrained_output_greedy_with_and_without_speculation(http, target, name):
    expected = library(target, forced(name), temperature=0.0, seed=0)
    assert expected.finish_reason == "eos"
    calls = []
    for speculative in (True, False):
        body = {"tool_choice": named(name), "tools": TOOLS, "temperature": 0, "parallel_tool_calls": speculative}
        data = post(http, **body, speculative=speculative).json()
        calls.append(the_call(data["choices"][0]))
        assert (data["usage"]["drafted_tokens"] > 0) == speculative  # the speculative request did draft
    assert calls[0] == calls[1]
    assert calls[0]["name"] == name and json.loads(expected.text) == {
        "name": name,
        "arguments": json.loads(calls[0]["arguments"]),
    }
    jsonschema.validate(json.loads(calls[0]["arguments"]), FUNCTIONS[name])
    free = post(http, temperature=0, speculative=False).json()["choices"][0]["message"]["content"]
    assert free != expected.text  # the control: without the tool call's grammar the model writes something else


def test_sampled_calls_replay_by_seed_and_required_picks_a_listed_function(http, target):
    names = set()
    for seed in range(12):
        body = {"tool_choice": "required", "tools": TOOLS, "temperature": 1.0, "seed": seed}
        whole = [the_call(post(http, **body, speculative=s).json()["choices"][0]) for s in (True, False)]
        assert whole[0] == whole[1]
        call = whole[0]
        jsonschema.validate(json.loads(call["arguments"]), FUNCTIONS[call["name"]])
        names.add(call["name"])
    assert names <= set(FUNCTIONS)
    either = call_grammar(BARE, FUNCTIONS, None, auto=False, parallel=False, strict=False, compact=True)
    constraint = Constraint(either, target.tokenizer, target.vocab_size, target.eos_token_ids)
    constraint.advance([TOOL_PIECES.index(piece) for piece in '{"name":"'])
    assert {TOOL_PIECES[i] for i in constraint.mask().nonzero().flatten().tolist()} == {
        "a",
        "b",
    }  # either name may come
    named_call = the_call(
        post(http, tool_choice=named("ab"), tools=TOOLS, temperature=1.0, seed=3).json()["choices"][0]
    )
    expected = json.loads(library(target, forced("ab"), temperature=1.0, seed=3).text)
    assert {"name": named_call["name"], "arguments": json.loads(named_call["arguments"])} == expected


def streamed_calls(deltas: list[dict]) -> list[dict]:
    """The calls of a stream's deltas, checked in OpenAI's shape: a call's first delta has its index, id, type and
    name (arguments ""), the others only the index and an arguments fragment."""
    calls: list[dict] = []
    for delta in deltas:
        for part in delta.get("tool_calls") or ():
            if part["index"] == len(calls):
                assert set(part) == {"index", "id", "type", "function"} and part["function"]["arguments"] == ""
                calls.append({"name": part["function"]["name"], "arguments": ""})
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}, part
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return calls


def test_a_streamed_call_comes_in_fragments_as_openai_streams_it(http):
    body = {"tool_choice": named("ab"), "tools": TOOLS, "temperature": 1.0, "seed": 5, "n": 2}
    whole = post(http, **body).json()["choices"]
    chunks = [json.loads(e) for e in events(post(http, **body, stream=True).text) if e != "[DONE]"]
    for index in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": None}
        assert all("content" not in c["delta"] for c in mine[1:])
        deltas = [c["delta"] for c in mine]
        assert sum(1 for d in deltas if d.get("tool_calls")) > 2  # the arguments in several fragments
        assert streamed_calls(deltas) == [the_call(whole[index])]
        assert mine[-1]["finish_reason"] == "tool_calls" and mine[-1]["delta"] == {}


def test_none_is_plain_text_without_tools_and_a_cut_call_is_text(http):
    free = post(http, temperature=1.0, seed=2).json()["choices"][0]
    none = post(http, tools=TOOLS, tool_choice="none", temperature=1.0, seed=2).json()["choices"][0]
    assert none == free and isinstance(none["message"]["content"], str)
    cut = post(http, tools=TOOLS, tool_choice=named("ab"), temperature=0, max_tokens=2).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"].startswith("{")


BAD = [
    ({"tools": TOOLS}, "tool_choice", '"auto"'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "tool-call convention"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": named("cab")}, "tool_choice", "'cab', not among the tools (ab, ba)"),
    ({"tools": [*TOOLS, TOOLS[0]], "tool_choice": "required"}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, "tools", "letters"),
    ({"tools": TOOLS * 200, "tool_choice": "none"}, "tools", "unique"),
    (
        {
            "tools": [{**t, "function": {**t["function"], "name": f"f{i}"}} for i in range(600) for t in TOOLS[:1]],
            "tool_choice": "required",
        },
        "messages",
        "context window",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tool_choice": "required",
        },
        "tools",
        "bad parameters schema",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["no"]}}]}, "tools", "parameters"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "one"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_tools_are_a_400_naming_the_field(http, extra, param, words):
    response = post(http, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "\n" not in error["message"]


def test_a_template_without_tool_support_is_one_400_saying_so():
    with serve(model(CHAT_TEMPLATE)) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        for choice in ("required", named("ab"), "auto", None):
            response = post(client, tools=TOOLS, **({} if choice is None else {"tool_choice": choice}))
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == "tools", error
            assert "chat template" in error["message"] and "tools are not supported" in error["message"]
        assert post(client, tools=TOOLS, tool_choice="none").status_code == 200


def test_the_openai_client_gets_tool_calls(server, target):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, tools=TOOLS, tool_choice=named("ba")
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    expected = json.loads(library(target, forced("ba"), temperature=0.0, seed=0).text)
    assert call.function.name == "ba" and json.loads(call.function.arguments) == expected["arguments"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        tools=TOOLS,
        tool_choice=named("ba"),
        stream=True,
    )
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in stream if c.choices]
    assert streamed_calls(deltas) == [{"name": "ba", "arguments": call.function.arguments}]


def test_a_call_and_its_result_go_back_through_the_template(http, target):
    """The tool loop's next turn: the answer's assistant message (its tool_calls) and a tool message are rendered by
    the template, the call's arguments as a mapping (transformers' convention)."""
    answer = post(http, tools=TOOLS, tool_choice=named("ab"), temperature=0).json()["choices"][0]["message"]
    result = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "ab"}
    turn = [*MESSAGES, answer, result]
    data = post(http, messages=turn, tools=TOOLS, tool_choice="required", temperature=0).json()
    arguments = json.loads(answer["tool_calls"][0]["function"]["arguments"])
    call = {"type": "function", "function": {"name": "ab", "arguments": arguments}}
    rendered = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "ab"},
    ]
    ids = target.tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    base = post(http, tools=TOOLS, tool_choice="required").json()["usage"]["prompt_tokens"]
    assert data["usage"]["prompt_tokens"] == len(ids) == base + 3  # the call's name, "ab" (a mapping), the result
    the_call(data["choices"][0])
    bad_arguments = {
        **answer,
        "tool_calls": [{**answer["tool_calls"][0], "function": {"name": "ab", "arguments": "[1]"}}],
    }
    for messages, words in (
        ([*MESSAGES, bad_arguments], "arguments must be a JSON object"),
        ([*MESSAGES, answer, {"role": "tool", "content": "ab"}], "tool_call_id"),
        ([*MESSAGES, answer, {"role": "tool", "tool_call_id": "call_x", "content": "ab"}], "matches no earlier"),
        ([*MESSAGES, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "ab"}], "matches no"),
        ([{**MESSAGES[0], "tool_calls": answer["tool_calls"]}], "assistant"),
    ):
        response = post(http, messages=messages)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "messages" and words in error["message"], error


HERMES_PIECES = ["<eos>", "x", "y", "<tool_call>", "</tool_call>", "\n", '{"name": "', "f", "g", '", "arguments": ']
HERMES_PIECES += ["{", "}", '"', "a", ":", "1"]
HERMES_FUNCTIONS = {
    "f": {"type": "object", "properties": {}, "additionalProperties": False},
    "g": {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"], "additionalProperties": False},
}
HERMES_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in HERMES_FUNCTIONS.items()]


def test_auto_on_a_hermes_template_answers_text_or_calls_as_the_library_does_whole_and_streamed():
    """A template with ``<tool_call>`` (the Hermes convention) over a vocabulary of a Hermes answer's pieces: each
    sampled answer is the library's output under the "auto" grammar, parsed into content and ``tool_calls``, the same
    with and without speculation, and its stream's deltas assemble into it."""
    tokenizer = piece_tokenizer(HERMES_PIECES)
    tokenizer.chat_template = "{% for t in tools or [] %}{{ t.function.name }} {% endfor %}<tool_call> x x y"
    target = with_eos(sd.load_model(tiny_llama(len(HERMES_PIECES), seed=0), tokenizer=tokenizer), 0)
    grammar = call_grammar(HERMES, HERMES_FUNCTIONS, tokenizer, auto=True, parallel=True, strict=False, compact=True)
    ids = target.chat_ids(MESSAGES, HERMES_TOOLS)
    kinds = set()
    with serve(target) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        for seed in range(8):
            params = sd.SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed, grammar=grammar)
            expected = sd.autoregressive_generate(target, ids, params)
            body = {"messages": MESSAGES, "tools": HERMES_TOOLS, "temperature": 1.0, "seed": seed, "max_tokens": 24}
            answers = [client.post(PATHS["chat"], json={**body, "speculative": s}).json() for s in (True, False)]
            assert "choices" in answers[0], answers[0]
            choice = answers[0]["choices"][0]
            for answer in answers:
                assert answer["choices"][0]["finish_reason"] == choice["finish_reason"]
                assert strip_ids(answer["choices"][0]["message"]) == strip_ids(choice["message"])
            message, called = CallParser(HERMES).message(expected.text, cut=expected.finish_reason == "length")
            assert strip_ids(choice["message"]) == strip_ids(message)
            kinds.add(choice["finish_reason"])
            chunks = [
                json.loads(e) for e in events(client.post(PATHS["chat"], json={**body, "stream": True}).text)[:-1]
            ]
            deltas = [c["choices"][0]["delta"] for c in chunks]
            assert deltas[0] == {"role": "assistant", "content": ""}
            content = "".join(d.get("content") or "" for d in deltas)
            assert content == (message["content"] or "")
            whole_calls = [c["function"] for c in message.get("tool_calls") or ()]
            if called:
                assert streamed_calls(deltas) == whole_calls
            assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert "tool_calls" in kinds and kinds - {"tool_calls"}  # both calls and text among the seeds


def strip_ids(message: dict) -> dict:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls") or ()]
    return {**message, "tool_calls": calls}
