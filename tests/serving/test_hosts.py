"""The Host allow-list (DNS rebinding): a request naming a host this server is not reached by gets OpenAI's 400
error body; localhost, 127.0.0.1, [::1], the bound address and --allowed-hosts names pass."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers.models import word_target

from specdecode.serving import ServerConfig, create_app
from specdecode.serving.hosts import HostCheck, host_name
from specdecode.serving.local import LocalServer


async def ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def status_for(host: str, bound: str = "127.0.0.1", allowed: tuple[str, ...] = ()) -> int:
    transport = httpx.ASGITransport(app=HostCheck(ok_app, bound, allowed))

    async def ask() -> int:
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return (await client.get("/v1/models", headers={"Host": host})).status_code

    return asyncio.run(ask())


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8000", "localhost"),
        ("[::1]:8000", "::1"),
        ("127.0.0.1", "127.0.0.1"),
        ("Evil.Example.:80", "evil.example"),
    ],
)
def test_host_name_drops_port_brackets_case_and_trailing_dot(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST", "app.localhost:1"])
def test_loopback_names_pass(host):
    assert status_for(host) == 200


@pytest.mark.parametrize("host", ["evil.example:8000", "evil.example", "127.0.0.1.evil.example", "10.0.0.5:8000"])
def test_other_hosts_are_refused_on_a_loopback_server(host):
    assert status_for(host) == 400


def test_the_bound_host_and_allowed_names_pass_and_star_turns_the_check_off():
    assert status_for("my.box:8000", bound="my.box") == 200
    assert status_for("models.lan:8000", allowed=("models.lan",)) == 200
    assert status_for("evil.example", allowed=("models.lan",)) == 400
    assert status_for("evil.example", allowed=("*",)) == 200


def test_a_wildcard_bind_answers_ip_literals_but_not_foreign_names():
    assert status_for("192.168.1.20:8000", bound="0.0.0.0") == 200  # an IP literal cannot be rebound
    assert status_for("evil.example:8000", bound="0.0.0.0") == 400


def test_the_server_refuses_a_rebound_host_with_an_openai_error_and_keeps_serving():
    config = ServerConfig(target=word_target(backend="native"), allowed_hosts=("models.lan",))
    with LocalServer(create_app(config)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        body = {"prompt": "w1 w2", "max_tokens": 3, "temperature": 0}
        refused = http.post("/v1/completions", json=body, headers={"Host": f"evil.example:{server.port}"})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "host_not_allowed" and error["type"] == "invalid_request_error"
        assert "evil.example" in error["message"] and "--allowed-hosts" in error["message"]
        assert http.post("/v1/completions", json=body).status_code == 200  # Host: 127.0.0.1:PORT
        assert http.get("/health", headers={"Host": "models.lan"}).status_code == 200
        assert http.get("/", headers={"Host": "evil.example"}).status_code == 400  # the page too
