"""ASGI middleware in front of the routes: the API key and the request-body size limit (``Guard``).

Every middleware is wired in one place: ``app.create_app``."""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from .openai.protocol import error_body

OPEN_PATHS = ("/health", "/", "/favicon.ico")  # and /static/...: the page holds no data; its API calls need the key
# A refused request's body (401, 413) is read and dropped up to this much, within this time, before the answer:
# a client that reads only after sending all of it (Python's http.client) then gets the error, not a reset. Past
# either bound the connection is closed: reading more would spend the server's bandwidth on a refused request.
DRAIN_BYTES = 64 * 2**20
DRAIN_SECONDS = 10.0


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


class Guard:
    """ASGI middleware: the API key (every route but /health) and the request-body size limit (413).

    The body is read here, before the app sees it (up to the limit: the app then reads it from memory). A refused
    request's body is read and dropped first (``_drain``), so that a client that sends its whole body before
    reading the answer (Python's ``http.client``) gets the error rather than a reset connection."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.expected is not None and path not in OPEN_PATHS and not path.startswith("/static/"):
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                await _refuse(401, message, "invalid_api_key", scope, receive, send, _drainable(headers))
                return
        limit = self.max_body_bytes
        too_large = (413, _too_large(limit), "request_too_large", scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _refuse(*too_large, _drainable(headers))
            return
        messages: list[dict] = []  # the body's messages, up to its end (or a disconnect)
        received, more = 0, True
        while more:
            messages.append(message := await receive())
            more = message["type"] == "http.request" and message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > limit:  # no Content-Length (a chunked body), or a body longer than it said
                await _refuse(*too_large, more)
                return
        replay = deque(messages)

        async def replayed() -> dict:
            return replay.popleft() if replay else await receive()

        await self.app(scope, replayed, send)


def _drainable(headers: dict[bytes, bytes]) -> bool:
    """Whether to read a refused request's unread body: not when the client waits for ``100 Continue`` (it sends
    nothing unless asked), nor when it says the body is longer than ``DRAIN_BYTES``."""
    length = headers.get(b"content-length", b"")
    return headers.get(b"expect", b"").lower() != b"100-continue" and not (
        length.isdigit() and int(length) > DRAIN_BYTES
    )


async def _refuse(
    status: int, message: str, code: str, scope: dict, receive: Callable, send: Callable, drain: bool
) -> None:
    """Answer ``status`` without running the app; with ``drain``, once the rest of the body has been read and
    dropped (``_drain``). Without it, or past the drain's bounds, the answer closes the connection."""
    response = error_response(status, message, None, code)
    if not (drain and await _drain(receive)):
        response.headers["Connection"] = "close"
    await response(scope, receive, send)


async def _drain(receive: Callable) -> bool:
    """Read and drop the request body up to its end: True if it ended within ``DRAIN_BYTES`` and ``DRAIN_SECONDS``."""

    async def read() -> bool:
        dropped = 0
        while dropped <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return False  # the client went away
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    try:
        return await asyncio.wait_for(read(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        return False


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes"
