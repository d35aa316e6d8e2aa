"""OpenAI's sampling fields over HTTP, honoured exactly or refused by name: presence/frequency penalties, logit_bias,
min_p and repetition_penalty give the library's own output (the server speculates, in reproducible mode: the same
tokens as plain sampling with the seed); ``n`` choices each follow their own seed; ``stream_options.include_usage``
and ``max_completion_tokens`` as OpenAI defines them; a field we do not honour (``tools``) or an
unknown one gets a 400 naming it — raw bodies and the ``openai`` client (``response_format`` itself:
tests/serving/openai/test_response_format.py)."""

from __future__ import annotations

import json

import openai
import pytest
from helpers.serving import PATHS, REPEATING, body_for, chat_ids, events

import specdecode as sd
from specdecode.serving.openai.responses import choice_seed

FIELDS = {
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 1.2},
    "repetition_penalty": {"repetition_penalty": 1.8},
    "logit_bias": {"logit_bias": {"42": 3.0, "48": -100}},  # w42 favoured, w48 (in every unbiased answer) banned
    "min_p": {"min_p": 0.3},
}


def library_params(fields: dict, **settings) -> sd.SamplingParams:
    """The body's fields as the library's SamplingParams (logit_bias keys as integers)."""
    fields = dict(fields)
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    return sd.SamplingParams(**settings, **fields)


def library(target, ids, fields: dict, **settings) -> sd.GenerationOutput:
    return sd.autoregressive_generate(target, ids, library_params(fields, **settings))


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "T0.9-seeded"])
@pytest.mark.parametrize("name", list(FIELDS))
def test_each_sampling_field_gives_the_librarys_output_speculating_or_not(http, target, name, temperature):
    """Speculating (the server's lookup proposer, gamma 4) and plain: the text of plain decoding with the field; and
    the field changes the text (it is not dropped) — min_p only when sampling (greedy ignores it)."""
    ids = target.encode(REPEATING)
    fields = FIELDS[name]
    settings = {"temperature": temperature, "max_new_tokens": 16, "seed": 11}
    expected = library(target, ids, fields, **settings).text
    without = library(target, ids, {}, **settings).text
    assert (expected == without) == (name == "min_p" and temperature == 0), (name, expected)
    for speculative in (True, False):
        body = {"prompt": REPEATING, "max_tokens": 16, "temperature": temperature, "seed": 11, **fields}
        data = http.post("/v1/completions", json={**body, "speculative": speculative}).json()
        assert data["choices"][0]["text"] == expected, (name, speculative, data)


def test_logit_bias_of_minus_100_bans_a_token(http, target):
    banned = target.encode("w2")[0]
    body = {"prompt": REPEATING, "max_tokens": 24, "temperature": 1.0, "seed": 3, "logit_bias": {str(banned): -100}}
    data = http.post("/v1/completions", json=body).json()
    assert banned not in target.encode(data["choices"][0]["text"]) and data["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_n_choices_each_follow_their_own_seed_whole_and_streamed(http, target, route):
    """n = 3: choice i is plain sampling with choice_seed(seed, i) (choice 0: the seed itself); the usage counts every
    choice's tokens once and the prompt once; streamed, each chunk names its choice, and include_usage's last chunk
    has the same usage."""
    ids = chat_ids(target, REPEATING) if route == "chat" else target.encode(REPEATING)
    outs = [library(target, ids, {}, temperature=1.0, max_new_tokens=10, seed=choice_seed(5, i)) for i in range(3)]
    expected = [o.text for o in outs]
    assert len(set(expected)) > 1 and choice_seed(5, 0) == 5
    body = body_for(route, REPEATING, max_tokens=10, temperature=1.0, seed=5, n=3)
    data = http.post(PATHS[route], json=body).json()
    key = (lambda c: c["message"]["content"]) if route == "chat" else (lambda c: c["text"])
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [key(c) for c in data["choices"]] == expected and data["seed"] == 5
    assert data["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in outs)
    assert data["usage"]["prompt_tokens"] == len(ids)

    streamed = http.post(PATHS[route], json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(d) for d in events(streamed.text)[:-1]]
    texts, finished = ["", "", ""], []
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if choice["finish_reason"]:
            finished.append(choice["index"])
    assert texts == expected and sorted(finished) == [0, 1, 2]
    assert (
        chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == data["usage"]["completion_tokens"]
    )


def test_max_completion_tokens_bounds_each_choice_and_wins_over_max_tokens(http, target):
    body = body_for("chat", REPEATING, max_tokens=12, max_completion_tokens=3, temperature=1.0, seed=1, n=2)
    data = http.post(PATHS["chat"], json=body).json()
    assert [c["finish_reason"] for c in data["choices"]] == ["length", "length"]
    assert data["usage"]["completion_tokens"] == 6


REFUSED = [
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "response_format"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools are not supported"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "tool_choice"),
    ("completions", {"response_format": {"type": "json_schema"}}, "response_format", "response_format"),
    ("completions", {"ignore_eos": True}, "ignore_eos", "unknown field ignore_eos"),
    ("chat", {"stream": True, "stream_options": {"bogus": True}}, "stream_options", "stream_options.bogus"),
    ("chat", {"messages": [{"role": "user", "content": "w1", "x": 1}]}, "messages", "unknown field messages.0.x"),
    ("completions", {"logit_bias": {"w1": 1}}, "logit_bias", "token ids"),
    ("completions", {"logit_bias": {"9999": 1}}, "logit_bias", "past the vocabulary"),
    ("completions", {"logit_bias": {"3": -101}}, "logit_bias", "[-100, 100]"),
    ("completions", {"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    ("completions", {"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("completions", {"min_p": 1.5}, "min_p", "[0, 1]"),
    ("completions", {"n": 0}, "n", "1..8"),
]


@pytest.mark.parametrize(("route", "extra", "param", "words"), REFUSED, ids=[r[2] + "-" + r[0] for r in REFUSED])
def test_fields_we_do_not_honour_or_know_get_a_400_naming_them(http, route, extra, param, words):
    body = {**body_for(route, "w1 w2", max_tokens=2), **extra}
    response = http.post(PATHS[route], json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_null_unhonoured_field_is_taken_as_absent(http):
    body = body_for("chat", "w1 w2", max_tokens=2, tools=None, response_format=None)
    assert http.post(PATHS["chat"], json=body).status_code == 200
    echoed = {"role": "assistant", "content": "w3", "refusal": None, "tool_calls": None}  # an earlier answer's message
    body = {"messages": [{"role": "user", "content": "w1"}, echoed, {"role": "user", "content": "w2"}], "max_tokens": 2}
    assert http.post(PATHS["chat"], json=body).status_code == 200
    refused = http.post(PATHS["chat"], json={**body, "messages": [{**echoed, "tool_calls": [{"id": "x"}]}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_n_choices_carry_their_own_logprobs(http, target):
    body = {"prompt": REPEATING, "max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 2, "logprobs": 1}
    for choice in http.post(PATHS["completions"], json=body).json()["choices"]:
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == choice["text"] and len(logprobs["token_logprobs"]) == 6
        offsets = [0, *[len(t) for t in logprobs["tokens"]]]
        assert logprobs["text_offset"] == [sum(offsets[: i + 1]) for i in range(6)]


def test_the_openai_client_sends_the_fields_and_gets_n_choices(server, target):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    fields = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {"5": 2.0}}
    extensions = {"min_p": 0.05, "repetition_penalty": 1.3}
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": REPEATING}],
        max_completion_tokens=8,
        temperature=0.9,
        seed=21,
        n=2,
        extra_body=extensions,
        **fields,
    )
    ids = chat_ids(target, REPEATING)
    expected = [
        library(target, ids, {**fields, **extensions}, temperature=0.9, max_new_tokens=8, seed=choice_seed(21, i)).text
        for i in range(2)
    ]
    assert [c.message.content for c in chat.choices] == expected
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": REPEATING}],
        max_completion_tokens=8,
        temperature=0.9,
        seed=21,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extensions,
        **fields,
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "w1"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )
