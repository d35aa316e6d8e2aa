"""The Host header allow-list: a defence against DNS rebinding.

A web page on ``evil.example`` can make the browser resolve its own name to 127.0.0.1 and then call a server on the
user's loopback as "same origin": the request reaches us with ``Host: evil.example:PORT``. Answering only the
names this server is reached by (``localhost``, ``127.0.0.1``, ``[::1]``, the address it is bound to, and
``--allowed-hosts``) refuses those requests with a 400 before any route runs. An IP literal cannot be rebound (a
page whose origin is an IP address is that address), so on a wildcard bind (``0.0.0.0``, ``::``), where clients
reach the server by any of the machine's addresses, every IP literal is allowed, and the machine's own names too.
``*`` in the list turns the check off (behind a proxy that rewrites Host, say).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable

from starlette.responses import JSONResponse

from .openai.protocol import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


def host_name(header: str) -> str:
    """The name in a Host header, lower-case, without its port, brackets or trailing dot: ``[::1]:8000`` -> ``::1``."""
    value = header.strip().lower()
    if value.startswith("["):
        value = value[1 : value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def allowed_names(bound: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host names a server bound to ``bound`` answers, plus ``extra``; None means any (``*`` in ``extra``)."""
    extra = [host_name(name) for name in extra]
    if "*" in extra:
        return None
    names = {*LOOPBACK_NAMES, host_name(bound), *extra}
    if host_name(bound) in WILDCARDS:
        names.update(host_name(name) for name in (socket.gethostname(), socket.getfqdn()))
    return frozenset(names - {""})


class HostCheck:
    """ASGI middleware: answer a request whose Host header names another host with OpenAI's 400 error body (a
    request without a Host header, HTTP/1.0's, passes: browsers always send one)."""

    def __init__(self, app: Callable, bound: str = "127.0.0.1", allowed: Iterable[str] = ()) -> None:
        self.app = app
        self.names = allowed_names(bound, allowed)
        self.any_ip = host_name(bound) in WILDCARDS

    def allows(self, header: str) -> bool:
        name = host_name(header)
        if self.names is None or name in self.names or name.endswith(".localhost"):
            return True
        return self.any_ip and _is_ip(name)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] in ("http", "websocket") and self.names is not None:
            header = dict(scope.get("headers") or []).get(b"host")
            if header is not None and not self.allows(header.decode("latin-1")):
                message = (
                    f"this server does not answer for the host {header.decode('latin-1')!r} (a defence against DNS "
                    "rebinding); reach it as localhost or its address, or start it with --allowed-hosts NAME"
                )
                response = JSONResponse(error_body(400, message, None, "host_not_allowed"), status_code=400)
                response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
