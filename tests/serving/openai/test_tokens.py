"""Per-token extras over HTTP: sources (``include_sources``) and logprobs, in OpenAI's shapes as the ``openai``
client parses them, streamed and not; greedy logprobs are identical with and without speculation, and the
sources' texts concatenate to the answer."""

from __future__ import annotations

import json

import openai
import pytest
from helpers.serving import PATHS, REPEATING, body_for, chat_ids, events, plain_text, streamed_text

import specdecode as sd


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(client, speculative, **extra):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": REPEATING}],
        max_tokens=32,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"speculative": speculative, "include_sources": True},
        **extra,
    )


def test_chat_logprobs_are_identical_with_and_without_speculation(client, target):
    plain, speculative = _chat(client, False), _chat(client, {"proposer": "lookup", "gamma": 4})
    expected = plain_text(target, chat_ids(target, REPEATING), 32)
    for response in (plain, speculative):
        choice = response.choices[0]
        assert choice.message.content == expected
        content = choice.logprobs.content
        assert len(content) == 32
        assert "".join(t.token for t in content) == expected
        for t in content:
            assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the best token
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
            assert t.logprob <= 0 and t.bytes == list(t.token.encode())
    assert [t.model_dump() for t in plain.choices[0].logprobs.content] == [
        t.model_dump() for t in speculative.choices[0].logprobs.content
    ]  # exactly, floats included
    sources = {name: r.choices[0].model_extra["sources"] for name, r in (("plain", plain), ("spec", speculative))}
    assert {s["source"] for s in sources["plain"]} == {"target"} and {s["kind"] for s in sources["plain"]} == {"plain"}
    assert {s["source"] for s in sources["spec"]} == {"draft", "target"}
    accepted = sum(s["source"] == "draft" for s in sources["spec"])
    assert accepted == speculative.usage.model_extra["accepted_tokens"] > 0
    for records in sources.values():
        assert "".join(s["text"] for s in records) == expected
        assert all(s["depth"] >= 1 for s in records)
    speculation = speculative.usage.model_extra["speculation"]
    assert speculation["rounds"] == sum(s["source"] == "target" for s in sources["spec"])
    assert speculation["tokens_per_round"] == pytest.approx(32 / speculation["rounds"])
    assert 0 < speculation["acceptance_by_depth"][0] <= 1


def test_streamed_sources_and_logprobs_follow_the_streamed_text(http, target):
    ids = chat_ids(target, REPEATING)
    expected = plain_text(target, ids, 32)
    body = body_for(
        "chat",
        REPEATING,
        max_tokens=32,
        temperature=0,
        logprobs=True,
        stream=True,
        stream_options={"include_sources": True, "include_usage": True},
    )
    data = events(http.post(PATHS["chat"], json=body).text)
    assert streamed_text(data) == expected
    chunks = [json.loads(d) for d in data[:-1] if json.loads(d)["choices"]]
    sent, described = "", ""
    for chunk in chunks:  # each chunk's records describe text streamed by then
        choice = chunk["choices"][0]
        sent += choice["delta"].get("content") or ""
        described += "".join(s["text"] for s in choice.get("sources", []))
        assert sent.startswith(described)
        if "sources" in choice:
            assert [t["token"] for t in choice["logprobs"]["content"]] == [s["text"] for s in choice["sources"]]
    assert sum("sources" in c["choices"][0] for c in chunks) > 4  # released as the text streamed, not at the end
    records = [s for c in chunks for s in c["choices"][0].get("sources", [])]
    assert len(records) == 32 and "".join(s["text"] for s in records) == expected
    assert {s["source"] for s in records} == {"draft", "target"}
    streamed_logprobs = [
        t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]
    ]
    whole = http.post(PATHS["chat"], json={**body, "stream": False, "stream_options": None}).json()
    assert streamed_logprobs == whole["choices"][0]["logprobs"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_in_the_legacy_shape(http, target, stream):
    expected = plain_text(target, target.encode(REPEATING), 24)
    body = body_for("completions", REPEATING, max_tokens=24, temperature=0, logprobs=2, stream=stream)
    response = http.post(PATHS["completions"], json=body)
    if stream:
        chunks = [json.loads(d)["choices"][0] for d in events(response.text)[:-1]]
        logprobs = [c["logprobs"] for c in chunks if c["logprobs"]]
        merged = {key: [x for lp in logprobs for x in lp[key]] for key in logprobs[0]}
        text = "".join(c["text"] for c in chunks)
    else:
        choice = response.json()["choices"][0]
        merged, text = choice["logprobs"], choice["text"]
    assert text == expected and "".join(merged["tokens"]) == expected
    assert len(merged["token_logprobs"]) == len(merged["top_logprobs"]) == 24
    assert merged["text_offset"] == [sum(len(t) for t in merged["tokens"][:i]) for i in range(24)]
    for top, logprob in zip(merged["top_logprobs"], merged["token_logprobs"], strict=True):
        assert len(top) <= 2 and max(top.values()) == logprob


def test_sources_stop_with_the_text_at_a_stop_string(http, target):
    full = plain_text(target, target.encode(REPEATING), 24)
    stop = full.split()[6]
    body = body_for("completions", REPEATING, max_tokens=24, temperature=0, stop=stop, include_sources=True)
    for stream in (False, True):
        response = http.post(PATHS["completions"], json={**body, "stream": stream})
        if stream:
            choices = [json.loads(d)["choices"][0] for d in events(response.text)[:-1]]
            text = "".join(c["text"] for c in choices)
            records = [s for c in choices for s in c.get("sources", [])]
        else:
            choice = response.json()["choices"][0]
            text, records = choice["text"], choice["sources"]
        assert text == full[: full.index(stop)]
        assert "".join(s["text"] for s in records) == text


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_logprobs_get_a_400_naming_the_field(http, route, extra, param):
    response = http.post(PATHS[route], json=body_for(route, "w1 w2", max_tokens=2, **extra))
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_the_speculation_route_says_what_is_offered_and_happening(http):
    state = http.get("/v1/speculation").json()
    assert state["model"] == "tiny" and state["proposers"][:2] == ["none", "lookup"]
    assert state["default"] == {"proposer": "lookup", "gamma": 4}
    assert state["mode"] == "reproducible" and state["running"] == 0 and state["waiting"] == 0
    assert isinstance(state["speculating"], bool)


def test_the_library_reports_the_same_logprobs_as_the_server(http, target):
    ids = target.encode(REPEATING)
    out = sd.autoregressive_generate(target, ids, sd.SamplingParams(max_new_tokens=12), logprobs=2)
    served = http.post(PATHS["completions"], json=body_for("completions", REPEATING, max_tokens=12, temperature=0,
                                                           logprobs=2)).json()  # fmt: skip
    assert served["choices"][0]["logprobs"]["token_logprobs"] == [lp.logprob for lp in out.logprobs]
