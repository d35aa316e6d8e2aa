"""The HTTP server, end to end: a real uvicorn server on a free loopback port over a tiny model (native runner).

Greedy texts are checked against ``autoregressive_generate`` on the same ids: with and without speculation,
streamed and not, alone and in a batch of 16. Bad input gets OpenAI-style 4xx errors and the server keeps
serving; a request that raises in the engine fails alone with a 500; a client that disconnects frees its slot.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import httpx
import openai
import pytest
import torch
from helpers.models import LARGE_VOCAB
from helpers.serving import PATHS, REPEATING, body_for, chat_ids, events, plain_text, streamed_text

import specdecode as sd
from specdecode.bench.serve_load import run_load, scrape
from specdecode.engine.request import Request
from specdecode.sampling.draft import EMPTY_DRAFT, Draft
from specdecode.serving import ServerConfig, create_app
from specdecode.serving.local import LocalServer

PROMPTS = [" ".join(f"w{(3 * i + j * j) % LARGE_VOCAB}" for j in range(4 + i % 5)) * 2 for i in range(16)]
API_KEY = "sekrit"


class CatchesUp:
    """Drafts on every other call, and pays 50 ms each time it does: the catch-up of a proposer with state after
    a round it did not draft (an EAGLE head after a plain step)."""

    def __init__(self):
        self.calls = 0

    def propose(self, context, k, params, generator):
        self.calls += 1
        if self.calls % 2:
            return EMPTY_DRAFT
        time.sleep(0.05)
        return sd.PromptLookupProposer().propose(context, k, params, generator) or Draft(torch.tensor([1]))


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_non_streaming_and_streaming_give_the_plain_greedy_text(http, target, route):
    ids = chat_ids(target, REPEATING) if route == "chat" else target.encode(REPEATING)
    expected = plain_text(target, ids, 24)
    body = body_for(route, REPEATING, max_tokens=24, temperature=0)
    response = http.post(PATHS[route], json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    assert data["object"] == ("chat.completion" if route == "chat" else "text_completion")
    assert data["model"] == "tiny" and data["id"]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    assert choice["message"]["role"] == "assistant" if route == "chat" else True
    assert text == expected
    assert choice["finish_reason"] == "length"
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 24
    assert usage["total_tokens"] == len(ids) + 24
    assert usage["drafted_tokens"] > 0 and 0 <= usage["accepted_tokens"] <= usage["drafted_tokens"]
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] == usage["accepted_tokens"]

    response = http.post(PATHS[route], json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    data = events(response.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if route == "chat" else "text_completion"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24  # include_usage
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    if route == "chat":
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert streamed_text(data) == expected
    assert len(chunks) > 4  # text arrived in pieces, not at the end


def test_speculation_on_or_off_gives_the_same_greedy_text(http, target):
    expected = plain_text(target, target.encode(REPEATING), 32)
    usages = {}
    for option in (False, True, {"proposer": "lookup", "gamma": 2}, {"gamma": "auto"}, None):
        body = body_for("completions", REPEATING, max_tokens=32, temperature=0, speculative=option)
        data = http.post("/v1/completions", json=body).json()
        assert data["choices"][0]["text"] == expected, option
        usages[json.dumps(option)] = data["usage"]
    assert usages["false"]["drafted_tokens"] == 0
    assert usages["null"]["drafted_tokens"] > 0 and usages['{"proposer": "lookup", "gamma": 2}']["drafted_tokens"] > 0


def test_seeded_sampling_is_reproducible_whatever_the_speculation(http, target):
    """Reproducible mode (the server's default): a seed gives plain sampling's text, speculating or not."""
    expected = plain_text(target, target.encode(REPEATING), 24, temperature=1.0, seed=7)
    for option in (False, None, {"gamma": 3}):
        body = body_for("completions", REPEATING, max_tokens=24, temperature=1.0, seed=7, speculative=option)
        data = http.post("/v1/completions", json=body).json()
        assert data["choices"][0]["text"] == expected
        assert data["seed"] == 7


def test_a_request_alone_and_in_a_batch_of_16_gives_the_same_greedy_text(http, target):
    expected = [plain_text(target, target.encode(p), 20) for p in PROMPTS]

    def ask(i: int) -> str:
        body = body_for("completions", PROMPTS[i], max_tokens=20, temperature=0, stream=i % 2 == 1)
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200
        return streamed_text(events(response.text)) if i % 2 else response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert got == expected


def test_the_transformers_runner_serves_the_same_texts_in_a_batch(target):
    """Runners without a batched pass (transformers') take one forward per request: same texts."""
    hf = sd.load_model(target.model, tokenizer=target.tokenizer, backend="transformers")
    expected = [plain_text(hf, hf.encode(p), 12) for p in PROMPTS[:6]]
    with LocalServer(create_app(ServerConfig(target=hf, gamma=3, policy="always"))) as running:
        bodies = [body_for("completions", p, max_tokens=12, temperature=0) for p in PROMPTS[:6]]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda b: httpx.post(f"{running.url}/v1/completions", json=b, timeout=60), bodies))
    assert [g.json()["choices"][0]["text"] for g in got] == expected


def test_a_prompt_given_as_token_ids_is_the_same_prompt(http, target):
    as_text = http.post("/v1/completions", json={"prompt": REPEATING, "max_tokens": 8, "temperature": 0}).json()
    ids = target.encode(REPEATING)
    for prompt in (ids, [ids]):
        as_ids = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
        assert as_ids["choices"][0]["text"] == as_text["choices"][0]["text"]


def test_token_trees_in_a_batch_with_chains(http, target):
    """A tree draft (prompt lookup with branches) is scored alone with its own positions and mask, next to
    batched chains; every text stays plain decoding's."""
    expected = [plain_text(target, target.encode(p), 20) for p in PROMPTS[:8]]

    def ask(i: int) -> dict:
        proposer = "tree" if i % 2 else "lookup"
        body = body_for("completions", PROMPTS[i], max_tokens=20, temperature=0, speculative={"proposer": proposer})
        return http.post("/v1/completions", json=body).json()

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert [g["choices"][0]["text"] for g in got] == expected
    assert sum(g["usage"]["drafted_tokens"] for g in got[1::2]) > 0


@pytest.mark.skipif(not hasattr(Request, "keep_hidden"), reason="the engine keeps no target features yet (EAGLE)")
def test_a_proposer_that_needs_the_targets_features_gets_one_row_per_position_in_a_batch(http, target):
    expected = [plain_text(target, target.encode(p), 20) for p in PROMPTS[:6]]

    def ask(i: int) -> dict:
        proposer = "features" if i % 2 else "lookup"
        body = body_for("completions", PROMPTS[i], max_tokens=20, temperature=0, speculative={"proposer": proposer})
        return http.post("/v1/completions", json=body)

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, range(6)))
    assert [g.status_code for g in got] == [200] * 6, [g.text for g in got]
    assert [g.json()["choices"][0]["text"] for g in got] == expected


BAD = [
    ("completions", b"{", 400, None),
    ("completions", b'{"prompt": "w1", "temperature": NaN}', 400, "temperature"),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"prompt": "w1", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "w1", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "w1", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "w1", "max_tokens": 1.5}, 400, "max_tokens"),
    ("completions", {"prompt": "w1", "stop": 3}, 400, "stop"),
    ("completions", {"prompt": "w1", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": ["w1", "w2"]}, 400, "prompt"),
    ("completions", {"prompt": [999]}, 400, None),
    ("completions", {"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "w1", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"prompt": "w1", "max_tokens": 600}, 400, "max_tokens"),
    ("completions", {"prompt": "w1 " * 600, "max_tokens": 4}, 400, "prompt"),
    ("completions", {"prompt": "w1", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "w1", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "w1", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "w1", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": "w1", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "w1", "n": 9}, 400, "n"),
    ("completions", {"prompt": "w1", "seed": -1}, 400, "seed"),
    ("completions", {"prompt": "w1", "speculative": {"proposer": "oracle"}}, 400, "speculative"),
    ("completions", {"prompt": "w1", "speculative": {"gamma": 0}}, 400, "speculative"),
    ("completions", {"prompt": "w1", "speculative": {"depth": 3}}, 400, "speculative"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "w1"}]}, 400, "messages"),
    ("chat", {"messages": "w1"}, 400, "messages"),
    ("chat", {"prompt": "w1"}, 400, "messages"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "w1"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(http, route, body, status, param):
    if isinstance(body, bytes):
        response = http.post(PATHS[route], content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(PATHS[route], json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    if param is not None:
        assert error["param"] == param, error
    ok = http.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 2})
    assert ok.status_code == 200


def test_oversized_body_is_refused_with_413(http):
    big = {"prompt": "w1 " * 40_000, "max_tokens": 2}
    response = http.post("/v1/completions", json=big)
    assert response.status_code == 413 and "100000 bytes" in response.json()["error"]["message"]
    chunked = http.post("/v1/completions", content=iter([json.dumps(big).encode()]))  # no Content-Length
    assert chunked.status_code == 413
    assert http.get("/health").json() == {"status": "ok"}


def stdlib_post(port: int, path: str, body: bytes, chunked: bool, **headers: str) -> tuple[int, dict]:
    """POST as Python's standard library does: the whole body is sent before the answer is read; with
    ``Connection: close``, as urllib.request sends it (the server closes after answering)."""
    connection = HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        content = iter([body[i : i + 2**16] for i in range(0, len(body), 2**16)]) if chunked else body
        headers = {"Content-Type": "application/json", "Connection": "close", **headers}
        connection.request("POST", path, body=content, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_8_mb_body_from_the_standard_library_client_gets_the_413_not_a_reset(server, http, chunked):
    body = json.dumps({"prompt": "w1 " * 2_700_000, "max_tokens": 2}).encode()
    assert len(body) > 8_000_000
    status, answer = stdlib_post(server.port, "/v1/completions", body, chunked)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert "100000 bytes" in answer["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 2}).status_code == 200


def test_models_health_and_metrics(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 512
    assert http.get("/health").status_code == 200
    http.post("/v1/completions", json={"prompt": REPEATING, "max_tokens": 16, "temperature": 0})
    metrics = scrape(str(http.base_url).rstrip("/"))
    for name in (
        "specdecode:num_requests_running",
        "specdecode:num_requests_waiting",
        "specdecode:prompt_tokens_total",
        "specdecode:generation_tokens_total",
        "specdecode:time_to_first_token_seconds_count",
        "specdecode:inter_token_latency_seconds_count",
        "specdecode:spec_decode_num_draft_tokens_total",
        "specdecode:spec_decode_num_accepted_tokens_total",
        "specdecode:spec_decode_enabled",
        "specdecode:spec_decode_predicted_speedup",
        "process_resident_memory_bytes",
    ):
        assert name in metrics, name
    assert metrics["specdecode:spec_decode_num_draft_tokens_total"] > 0
    assert metrics["specdecode:generation_tokens_total"] >= 16
    assert any(k.startswith("specdecode:spec_decode_num_accepted_tokens_per_pos_total") for k in metrics)
    assert any(k.startswith("specdecode:batch_pass_seconds") for k in metrics)
    assert http.get("/nowhere").json()["error"]["message"]


def _idle(http, aborted_before: float, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(str(http.base_url).rstrip("/"))
        aborted = metrics["specdecode:request_aborted_total"] > aborted_before
        if aborted and metrics["specdecode:num_requests_running"] == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(http, server):
    before = scrape(server.url)["specdecode:request_aborted_total"]
    body = {"prompt": "w1 w2", "max_tokens": 400, "stream": True, "speculative": {"proposer": "slow"}}
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert scrape(server.url)["specdecode:num_requests_running"] == 1
    metrics = _idle(http, before)
    assert metrics["specdecode:num_requests_running"] == 0
    assert metrics["specdecode:request_aborted_total"] == before + 1
    _assert_slots_pooled(metrics)


def _assert_slots_pooled(metrics: dict[str, float]) -> None:
    """Idle: every slot back in the pool with an empty cache, and never more slots than the batch holds."""
    assert 1 <= metrics["specdecode:kv_slots"] <= ServerConfig.__dataclass_fields__["max_batch"].default
    assert metrics["specdecode:kv_slots_free"] == metrics["specdecode:kv_slots"]
    assert metrics["specdecode:kv_cache_tokens"] == 0


def test_a_client_that_gives_up_waiting_frees_its_slot(http, server):
    before = scrape(server.url)["specdecode:request_aborted_total"]
    body = {"prompt": "w1 w2", "max_tokens": 400, "speculative": {"proposer": "slow"}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    metrics = _idle(http, before)
    assert metrics["specdecode:num_requests_running"] == 0
    assert metrics["specdecode:request_aborted_total"] == before + 1
    _assert_slots_pooled(metrics)


def test_a_request_that_raises_in_the_engine_fails_alone(http, target):
    expected = plain_text(target, target.encode(REPEATING), 16)
    good = body_for("completions", REPEATING, max_tokens=16, temperature=0)
    boom = {**good, "speculative": {"proposer": "boom"}}
    late = {**good, "stream": True, "speculative": {"proposer": "late-boom"}}
    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(http.post, "/v1/completions", json=good) for _ in range(4)]
        booms = [pool.submit(http.post, "/v1/completions", json=b) for b in (boom, {**boom, "stream": True})]
        late_response = pool.submit(http.post, "/v1/completions", json=late).result()
    for future in goods:
        assert future.result().status_code == 200 and future.result().json()["choices"][0]["text"] == expected
    for future in booms:
        response = future.result()
        assert response.status_code == 500
        assert "boom" in response.json()["error"]["message"] and response.json()["error"]["type"] == "server_error"
    data = events(late_response.text)  # the failure came after the first tokens: an error event, then [DONE]
    assert late_response.status_code == 200 and data[-1] == "[DONE]"
    assert "late boom" in json.loads(data[-2])["error"]["message"]
    assert http.post("/v1/completions", json=good).json()["choices"][0]["text"] == expected


@pytest.fixture(scope="module")
def locked_server(target):
    with LocalServer(create_app(ServerConfig(target=target, api_key=API_KEY, served_model_name="tiny"))) as running:
        yield running


def test_api_key_is_checked_on_every_route_but_health(locked_server):
    url = locked_server.url
    assert httpx.get(f"{url}/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.request(method, f"{url}{path}", headers=headers, json={"prompt": "w1"})
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200
    status, answer = stdlib_post(locked_server.port, "/v1/completions", b" " * 8_000_000, chunked=False)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"  # the body read first: no reset


def test_the_official_openai_client_works_unchanged(locked_server, target):
    client = openai.OpenAI(base_url=f"{locked_server.url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt=REPEATING, max_tokens=16, temperature=0)
    assert completion.choices[0].text == plain_text(target, target.encode(REPEATING), 16)
    assert completion.usage.completion_tokens == 16
    accepted = completion.usage.completion_tokens_details.accepted_prediction_tokens
    assert accepted == completion.usage.model_extra["accepted_tokens"] <= completion.usage.model_extra["drafted_tokens"]
    expected = plain_text(target, chat_ids(target, REPEATING), 16)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": REPEATING}], max_tokens=16, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": REPEATING}],
        max_tokens=16,
        temperature=0,
        extra_body={"speculative": False, "top_k": 5},
    )
    assert chat.choices[0].message.content == expected and chat.usage.model_extra["drafted_tokens"] == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="w1", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="w1", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{locked_server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_32_concurrent_streaming_clients_lose_nothing(server, target):
    """A short load test: every stream ends in [DONE], none errs, each text is its prompt's greedy text."""
    prompts = PROMPTS[:8]
    bodies = [body_for("completions", p, max_tokens=24, temperature=0) for p in prompts]
    expected = [plain_text(target, target.encode(p), 24) for p in prompts]
    rss_before = scrape(server.url)["process_resident_memory_bytes"]
    record = run_load(server.url, bodies, clients=32, duration=4.0, path="/v1/completions", drain=True)
    rss_after = scrape(server.url)["process_resident_memory_bytes"]
    summary = record.summary()
    print(
        f"\n32 clients: {len(record.streams)} streams, {summary['tokens_per_s']:.0f} tokens/s, TTFT p99 "
        f"{summary['ttft_p99_s'] * 1000:.0f} ms, ITL p99 {summary['itl_p99_s'] * 1000:.1f} ms, RSS growth "
        f"{(rss_after - rss_before) / 2**20:+.1f} MiB"
    )
    assert len(record.streams) >= 32
    assert not record.errors and all(s.done for s in record.streams)
    assert all(s.text == expected[s.prompt_index] for s in record.streams)
    assert sum(s.tokens for s in record.streams) == 24 * len(record.streams)
    idle = scrape(server.url)
    assert idle["specdecode:num_requests_running"] == 0
    _assert_slots_pooled(idle)  # 32 clients never made more than max_batch slots
    # Memory: the 16 slots' KV caches of this tiny model are ~1 MiB in all; the rest is allocator and
    # connection slack. A leak of a cache or a request's state per stream (hundreds of streams) would exceed it.
    assert rss_after - rss_before < 64 * 2**20, f"RSS grew {(rss_after - rss_before) / 2**20:.0f} MiB"


def test_engine_thread_batches_requests_of_mixed_prompt_lengths_in_one_pass(target, monkeypatch):
    """The scheduler gathers every active request into one forward_batch call."""

    calls = []
    runner_class = type(target.new_runner())
    real = runner_class.forward_batch

    def spy(self, runners, tokens):
        calls.append([int(t.shape[0]) for t in tokens])
        return real(self, runners, tokens)

    monkeypatch.setattr(runner_class, "forward_batch", spy)
    with LocalServer(create_app(ServerConfig(target=target, policy="never"))) as running:
        bodies = [body_for("completions", p, max_tokens=12, temperature=0) for p in PROMPTS[:6]]
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda b: httpx.post(f"{running.url}/v1/completions", json=b, timeout=60), bodies))
    assert max(len(c) for c in calls) > 1 and all(set(c) == {1} for c in calls)  # plain steps, several rows


@pytest.fixture
def cli_target(monkeypatch, target):
    """Every model name the CLI (or the server it builds) loads is the tiny target."""
    from specdecode import factory

    monkeypatch.setattr(factory, "load", lambda name, *settings: target)
    return target


def test_serve_command_builds_the_app_and_hands_it_to_uvicorn(cli_target, monkeypatch):
    from typer.testing import CliRunner

    import specdecode.cli as cli
    from specdecode.serving.shutdown import GracefulServer

    seen = {}

    def run(server, sockets=None):
        seen.update(app=server.config.app, host=server.config.host, port=server.config.port)

    monkeypatch.setattr(GracefulServer, "run", run)
    result = CliRunner().invoke(cli.app, ["serve", "--port", "8123", "--gamma", "3", "--served-model-name", "tiny"])
    assert result.exit_code == 0, result.output
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123  # loopback unless told otherwise
    with LocalServer(seen["app"]) as running:
        body = {"prompt": REPEATING, "max_tokens": 8, "temperature": 0}
        assert httpx.post(f"{running.url}/v1/completions", json=body).json()["choices"][0]["text"] == plain_text(
            cli_target, cli_target.encode(REPEATING), 8
        )
    for args in (["--policy", "sometimes"], ["--replicas", "2"], ["--gamma", "0"], ["--mode", "fast"]):
        result = CliRunner().invoke(cli.app, ["serve", *args])
        assert result.exit_code != 0 and "error:" in result.output and "Traceback" not in result.output


def test_bench_serve_writes_a_report_and_plots(cli_target, tmp_path):
    from typer.testing import CliRunner

    import specdecode.cli as cli

    args = ["bench-serve", "--clients", "1,2", "--duration", "0.5", "--warmup", "0", "--max-tokens", "8"]
    result = CliRunner().invoke(cli.app, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "serve_results.json").read_text())
    assert [(r["clients"], r["policy"]) for r in data["rows"]] == [
        (c, p) for c in (1, 2) for p in ("always", "never", "auto")
    ]
    assert all(r["errors"] == 0 and r["tokens"] > 0 for r in data["rows"])
    report = (tmp_path / "serve_report.md").read_text()
    assert "| 2 | auto |" in report and "best fixed policy" in report
    for name in ("serve_tokens_per_s.png", "serve_ttft.png", "serve_itl.png"):
        assert (tmp_path / name).stat().st_size > 1000
    refused = CliRunner().invoke(cli.app, [*args, "--suffix-scope", "user", "--out", str(tmp_path / "x")])
    assert refused.exit_code != 0 and "--suffix-scope must be global or request" in refused.output
    assert "Traceback" not in refused.output


def test_bench_serve_rotates_the_policy_order_and_starts_each_run_fresh(target):
    """Bench fairness: no policy always runs first (or after the same one), with one repeat too, and each run
    starts without the acceptance priors and draft costs the run before it taught the engine."""
    from specdecode.commands.bench_serve import run_order

    runs = run_order([1, 4, 16], 1, ["always", "never", "auto"])
    firsts = [runs[i][2] for i in range(0, len(runs), 3)]
    assert firsts == ["always", "never", "auto"]
    assert sorted(runs) == sorted((n, 0, p) for n in (1, 4, 16) for p in ("always", "never", "auto"))
    assert [p for _, r, p in run_order([1], 2, ["always", "never"])] == ["always", "never", "never", "always"]
    with LocalServer(create_app(ServerConfig(target=target, policy="always"))) as running:
        body = body_for("completions", REPEATING, max_tokens=16, temperature=0)
        assert httpx.post(f"{running.url}/v1/completions", json=body).status_code == 200
        scheduler = running.app.state.server.scheduler
        assert scheduler._acceptance  # learned from that request
        scheduler.forget_learned()
        assert not scheduler._acceptance and not scheduler.policy.costs.draft_token_seconds


@pytest.mark.parametrize("scope", ["global", "request"])
def test_suffix_history_is_shared_by_requests_only_in_global_scope_and_saved_at_shutdown(target, tmp_path, scope):
    cache = tmp_path / "history.bin"
    config = ServerConfig(
        target=target, proposer="suffix", gamma=8, policy="always", suffix_cache=str(cache), suffix_scope=scope
    )
    prompt = "w10 w21 w32 w43 w54 w5 w16"
    expected = plain_text(target, target.encode(prompt), 32)
    with LocalServer(create_app(config)) as running:
        body = body_for("completions", prompt, max_tokens=32, temperature=0)
        answers = [httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json() for _ in range(2)]
    assert [a["choices"][0]["text"] for a in answers] == [expected, expected]
    first, again = (a["usage"] for a in answers)
    if scope == "global":  # the repeat is copied from the first answer, almost every token a guess
        assert again["accepted_tokens"] >= 0.75 * again["completion_tokens"] > first["accepted_tokens"]
        from specdecode.proposers import SuffixHistory

        assert SuffixHistory.load(cache).documents == 2
    else:
        assert again["accepted_tokens"] == first["accepted_tokens"] and not cache.exists()


def test_suffix_options_are_checked():
    with pytest.raises(ValueError, match="suffix_scope must be one of global, request"):
        ServerConfig(proposer="suffix", suffix_scope="user")
    with pytest.raises(ValueError, match="--suffix-cache applies to --proposer suffix"):
        ServerConfig(proposer="lookup", suffix_cache="x.bin")


def test_a_round_after_one_its_proposer_did_not_draft_is_not_a_drafting_price(target):
    """Every drafted round of ``CatchesUp`` follows an empty one and holds a 50 ms catch-up: none is priced (the
    policy would take the head for dear and stop drafting), while its acceptance is still learned."""
    config = ServerConfig(target=target, gamma=4, policy="always", proposers={"catches-up": CatchesUp})
    with LocalServer(create_app(config)) as running:
        body = body_for("completions", REPEATING, max_tokens=16, temperature=0, speculative={"proposer": "catches-up"})
        answer = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == plain_text(target, target.encode(REPEATING), 16)
        scheduler = running.app.state.server.scheduler
        assert "catches-up" in scheduler._acceptance and "catches-up" not in scheduler.policy.costs.draft_token_seconds
        assert "lookup" not in scheduler.policy.costs.draft_token_seconds  # no request drafted with it
        body["speculative"] = {"proposer": "lookup"}
        assert httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert scheduler.policy.costs.draft_token_seconds["lookup"] < 0.05  # rounds in a row: priced
