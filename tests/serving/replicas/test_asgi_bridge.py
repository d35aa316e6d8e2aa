"""The front that Ray Serve runs before the model replicas (asgi_bridge), with the replicas in this process: answers
forwarded unchanged; a replica that dies mid-stream ends the stream with an error event and [DONE]; one that dies
before answering gets the request sent again, then a 503 with Retry-After; a client that leaves cancels its request
in the engine. The same with real Ray replicas killed by signal: tests/serving/test_serving_slow.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from helpers.models import word_target

from specdecode.bench.serve_load import scrape
from specdecode.serving import ServerConfig, create_app
from specdecode.serving.local import LocalServer
from specdecode.serving.replicas.asgi_bridge import Forwarder, RawRequest, relay


class ReplicaDied(Exception):
    """What the Ray layer raises for a replica that is gone."""


class Replicas:
    """The model app behind ``relay``, as a model replica serves it, with faults on demand: ``die_after`` batches
    (0: before the first), for the next ``dying`` requests."""

    def __init__(self, app) -> None:
        self.app = app
        self.die_after = 0
        self.dying = 0
        self.error: type[Exception] = ReplicaDied
        self.opened = 0

    async def open_stream(self, request: RawRequest):
        self.opened += 1
        dies, self.dying = self.dying > 0, max(0, self.dying - 1)
        if dies and self.die_after == 0:
            raise self.error("the replica is gone")
        sent = 0
        async for batch in relay(self.app, request):
            yield batch
            sent += 1
            if dies and sent >= self.die_after:
                raise self.error("the replica is gone")


class Front:
    """The front's app with the model's lifespan run in the same loop (Ray runs it in the replica's process)."""

    def __init__(self, replicas: Replicas, forwarder=None) -> None:
        self.app = replicas.app
        self.forwarder = forwarder or Forwarder(replicas.open_stream, lambda e: isinstance(e, ReplicaDied), retries=2)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            async with self.app.router.lifespan_context(self.app):  # as ray_app's model replica runs it
                await self.forwarder(scope, receive, send)
            return
        await self.forwarder(scope, receive, send)


@pytest.fixture(scope="module")
def served():
    app = create_app(ServerConfig(target=word_target(backend="native")))
    replicas = Replicas(app)
    with LocalServer(Front(replicas)) as front:
        yield front, replicas


@pytest.fixture
def front(served):
    front, replicas = served
    replicas.dying, replicas.die_after, replicas.error = 0, 0, ReplicaDied
    return front, replicas


BODY = {"prompt": "w1 w2 w3", "max_tokens": 40, "temperature": 0}


def events(response: httpx.Response) -> list:
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in data]


def wait_idle(url: str) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while (metrics := scrape(url))["specdecode:num_requests_running"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return metrics


def test_forwarded_answers_are_the_apps(front):
    server, _ = front
    answer = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert answer.status_code == 200
    streamed = httpx.post(f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=60)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = events(streamed)
    assert chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == answer.json()["choices"][0]["text"]
    bad = httpx.post(f"{server.url}/v1/completions", json={**BODY, "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["object"] == "model"
    assert httpx.get(f"{server.url}/v1/models?x=1").status_code == 200
    assert httpx.get(f"{server.url}/nowhere").status_code == 404


def test_a_replica_that_dies_mid_stream_ends_it_with_an_error_event(front):
    server, replicas = front
    replicas.dying, replicas.die_after = 1, 5
    streamed = httpx.post(f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=60)
    assert streamed.status_code == 200
    chunks = events(streamed)
    assert chunks[-1] == "[DONE]" and "replica" in chunks[-2]["error"]["message"]
    assert chunks[-2]["error"]["type"] == "server_error"
    assert all("choices" in c for c in chunks[:-2]) and len(chunks) >= 4  # what came before the fault
    # the next request is answered (by the surviving replica)
    assert httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60).status_code == 200


def test_a_replica_that_dies_before_answering_gets_the_request_sent_again(front):
    server, replicas = front
    expected = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    opened = replicas.opened
    replicas.dying = 2  # twice gone, the third replica answers
    answer = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
    assert replicas.opened == opened + 3


def test_when_every_try_finds_the_replica_gone_the_answer_is_a_503_to_retry(front):
    server, replicas = front
    replicas.dying = 3
    answer = httpx.post(f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=60)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert answer.json()["error"]["type"] == "server_error"


def test_another_failure_is_not_retried_and_answers_500(front):
    server, replicas = front
    opened = replicas.opened
    replicas.dying, replicas.error = 1, ValueError
    answer = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
    assert answer.status_code == 500 and "ValueError" in answer.json()["error"]["message"]
    assert replicas.opened == opened + 1


def test_a_client_that_leaves_mid_stream_cancels_its_request_in_the_engine(front):
    server, _ = front
    before = wait_idle(server.url)["specdecode:request_aborted_total"]
    body = {**BODY, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    assert wait_idle(server.url)["specdecode:request_aborted_total"] == before + 1


class Handle:
    """A stand-in for the Ray handle ``ray_app.front`` calls: ``options(stream=True).relay.remote(request)``, an
    async iterator of the replica's batches with ``cancel()``."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.relay = self
        self.cancelled = 0

    def options(self, stream: bool) -> Handle:
        assert stream
        return self

    def remote(self, request: RawRequest):
        handle, stream = self, self.replicas.open_stream(request)

        class Stream:
            def __aiter__(self):
                return stream

            def cancel(self) -> None:
                handle.cancelled += 1

        return Stream()


def test_the_ray_front_checks_the_host_and_the_key_before_relaying():
    from specdecode.serving.replicas.ray_app import front

    config = ServerConfig(target=word_target(backend="native"), api_key="k")
    replicas = Replicas(create_app(config))
    handle = Handle(replicas)
    with LocalServer(Front(replicas, front(handle, config))) as server:
        key = {"Authorization": "Bearer k"}
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, headers=key, timeout=60).status_code == 200
        assert replicas.opened == 1 and handle.cancelled == 1
        refused = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)
        assert refused.status_code == 401 and replicas.opened == 1  # refused at the front
        rebound = httpx.get(f"{server.url}/v1/models", headers={**key, "Host": "evil.example"})
        assert rebound.status_code == 400 and replicas.opened == 1
