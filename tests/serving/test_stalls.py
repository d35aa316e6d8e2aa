"""A client that opens a stream and never reads it: its stream fills the socket and write buffers, is cut once a
write has waited the stall bound (here 1 s), and its request leaves the engine (counted as aborted, slot freed);
another client's stream meanwhile gets every token and its final chunk."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest
from helpers.models import word_target

from specdecode.bench.serve_load import scrape
from specdecode.sampling.draft import EMPTY_DRAFT
from specdecode.serving import ServerConfig, create_app, stalls
from specdecode.serving.local import LocalServer


class Slow:
    """Drafts nothing, slowly (20 ms a step): the never-read stream is still running when its buffers fill."""

    def propose(self, context, k, params, generator):
        time.sleep(0.02)
        return EMPTY_DRAFT


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(stalls, "STALL_SECONDS", 1.0)
    config = ServerConfig(target=word_target(backend="native"), proposers={"slow": Slow})
    local = LocalServer(create_app(config))
    # a small send buffer on the listening socket (accepted ones inherit it): the kernel would otherwise grow it
    # to megabytes on loopback before uvicorn's own 64 KiB write buffer fills
    local._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with local as running:
        yield running


def open_and_never_read(port: int, body: dict) -> socket.socket:
    """A raw client with a 2 KB receive buffer that sends its request and reads nothing."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    client.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    client.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return client


def test_a_client_that_never_reads_is_cut_and_other_streams_keep_coming(server):
    before = scrape(server.url)["specdecode:request_aborted_total"]
    stuck = {"prompt": "w1 w2", "max_tokens": 450, "stream": True, "logprobs": 5, "speculative": {"proposer": "slow"}}
    silent = open_and_never_read(server.port, stuck)  # ~500-byte chunks: its buffers fill within ~200 tokens
    try:
        deadline = time.monotonic() + 30
        while scrape(server.url)["specdecode:num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        other = {"prompt": "w3 w4", "max_tokens": 200, "stream": True, "temperature": 0,
             "stream_options": {"include_usage": True}}  # fmt: skip
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=other, timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 200  # every token came
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics = scrape(server.url)
            if metrics["specdecode:request_aborted_total"] > before and metrics["specdecode:num_requests_running"] == 0:
                break
            time.sleep(0.1)
        assert metrics["specdecode:request_aborted_total"] == before + 1  # the silent one left the engine early
        silent.settimeout(10)
        received = b""
        with contextlib.suppress(ConnectionResetError):  # the server aborted the connection (a reset)
            while chunk := silent.recv(65536):  # what the client's buffer held, then the end
                received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    finally:
        silent.close()
    assert httpx.get(f"{server.url}/health").status_code == 200
