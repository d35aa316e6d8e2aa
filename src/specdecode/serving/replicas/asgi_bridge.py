"""HTTP requests carried from a front process to the process that holds the model, as ASGI messages, so that a
model process that dies mid-response ends its streams with an error event rather than a cut connection.

Ray Serve's proxy relays its ingress replica's ASGI messages; when that replica dies mid-stream the proxy can only
drop the connection (the client reads an incomplete chunked body). So under Ray the HTTP side is a light front that
holds no model (in the ``serve --ray`` process, or as Ray's ingress): ``Forwarder`` reads each request and sends it
(a ``RawRequest``) to a model replica, which runs the app on it (``relay``) and streams the app's messages back.
When the replica fails, the front still holds the client's connection and ends it properly:

- before the response has started: the request is sent again (Ray routes it to a live replica), up to ``retries``
  times for a replica that is gone, then a 503 JSON error with ``Retry-After``;
- after an event stream has started: an error event (OpenAI's shape: the client libraries raise it) and
  ``data: [DONE]``;
- after another kind of body has started (never, for this server's JSON answers, which are one message): the body
  ends.

Nothing here imports Ray: the model's side is any ``open_stream(request) -> async iterator of message batches``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..middleware import error_response
from ..openai.protocol import error_body

log = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 5  # only when no replica answers; Ray restarts a killed one in ~15 s (BENCHMARKS.md)
Message = dict[str, Any]
OpenStream = Callable[["RawRequest"], AsyncIterator[list[Message]]]
_running: set[asyncio.Task] = set()  # apps still finishing a request whose consumer left (kept from the collector)


@dataclass(frozen=True)
class RawRequest:
    """An HTTP request as the ASGI scope states it, with its whole body: what crosses the process boundary."""

    method: str
    path: str
    raw_path: bytes | None
    query_string: bytes
    root_path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None
    server: tuple[str, int] | None
    scheme: str
    http_version: str

    @classmethod
    async def read(cls, scope: dict, receive: Callable) -> RawRequest | None:
        """The request with its body read to the end; None if the client left first. The body's size is bounded
        by the middleware in front (``Guard``)."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return cls(
            method=scope["method"],
            path=scope["path"],
            raw_path=scope.get("raw_path"),
            query_string=scope.get("query_string", b""),
            root_path=scope.get("root_path", ""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers") or ()),
            body=b"".join(chunks),
            client=tuple(scope["client"]) if scope.get("client") else None,
            server=tuple(scope["server"]) if scope.get("server") else None,
            scheme=scope.get("scheme", "http"),
            http_version=scope.get("http_version", "1.1"),
        )

    def scope(self) -> dict:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.http_version,
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.raw_path,
            "query_string": self.query_string,
            "root_path": self.root_path,
            "headers": [list(pair) for pair in self.headers],
            "client": self.client,
            "server": self.server,
            "state": {},
        }


async def relay(app: Callable, request: RawRequest) -> AsyncIterator[list[Message]]:
    """Run the ASGI ``app`` on ``request`` and yield what it sends, in batches (whatever it sent since the last
    batch was taken), the response's last message last. An error in the app is raised here. If the consumer stops
    early (the generator is closed or cancelled: the client left), the app receives ``http.disconnect`` and
    finishes on its own (the server then cancels the request in the engine)."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()  # None: the app returned
    gone = asyncio.Event()
    body = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> Message:
        if body:
            return body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(request.scope(), receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    _running.add(task)
    task.add_done_callback(_running.discard)
    try:
        ended = False
        while not ended:
            batch = [await sent.get()]
            while not sent.empty():
                batch.append(sent.get_nowait())
            if batch[-1] is None:
                ended = True
                batch.pop()
            if batch:
                yield batch  # type: ignore[misc]
        await task  # the app's error, if it raised one
    finally:
        gone.set()


class Forwarder:
    """The front's ASGI app: each request to ``open_stream`` (a model replica), its messages back to the client;
    a replica that fails ends the response as the module states. ``retryable(error)``: the replica is gone (the
    request may go to another one)."""

    def __init__(self, open_stream: OpenStream, retryable: Callable[[BaseException], bool], retries: int = 2) -> None:
        self.open_stream = open_stream
        self.retryable = retryable
        self.retries = retries

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await _lifespan_without_work(receive, send)
            return
        if scope["type"] != "http":
            raise RuntimeError(f"the front forwards HTTP only, not {scope['type']}")
        request = await RawRequest.read(scope, receive)
        if request is None:
            return
        forward = asyncio.create_task(self._forward(request, scope, receive, send))
        left = asyncio.create_task(_client_left(receive))
        try:
            await asyncio.wait({forward, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # the client left (or this request was cancelled, as Ray's proxy does when it sees the client go):
            left.cancel()  # the replica's stream is closed, its app sees the disconnect
            if not forward.done():
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward
        if not forward.cancelled():
            forward.result()

    async def _forward(self, request: RawRequest, scope: dict, receive: Callable, send: Callable) -> None:
        for attempt in range(self.retries + 1):
            started = streaming = False
            try:
                async with contextlib.aclosing(self.open_stream(request)) as stream:
                    async for batch in stream:
                        for message in batch:
                            if message["type"] == "http.response.start":
                                started = True
                                streaming = _content_type(message).startswith(b"text/event-stream")
                            await send(message)
                return
            except Exception as error:  # the replica failed: what the client gets depends on what it has had
                gone = self.retryable(error)
                what = "stopped" if gone else f"failed ({type(error).__name__})"
                if started:
                    log.warning("the model replica answering %s %s %s mid-response", request.method, request.path, what)
                    await _end_started(send, streaming, f"the model replica answering this request {what}; retry")
                    return
                if gone and attempt < self.retries:
                    log.warning("the model replica for %s %s %s: sent again", request.method, request.path, what)
                    continue
                log.warning("%s %s: the model replica %s", request.method, request.path, what, exc_info=not gone)
                response = error_response(503 if gone else 500, f"the model replica {what}; retry")
                if gone:
                    response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
                await response(scope, receive, send)
                return


async def _client_left(receive: Callable) -> None:
    """Returns when the client has gone (its request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _end_started(send: Callable, streaming: bool, message: str) -> None:
    """End a response whose head (and maybe some body) was sent: an event stream with an error event and
    ``[DONE]``, any other body as it stands."""
    tail = b""
    if streaming:
        event = json.dumps(error_body(500, message))
        tail = f"data: {event}\n\ndata: [DONE]\n\n".encode()
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _content_type(start: Message) -> bytes:
    return next((v for k, v in start.get("headers", ()) if bytes(k).lower() == b"content-type"), b"")


async def _lifespan_without_work(receive: Callable, send: Callable) -> None:
    """ASGI lifespan for an app that has nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
