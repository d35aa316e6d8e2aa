"""A client that stops reading its stream: buffered up to a bound, then cut.

The engine never waits for a client: it hands each step's text to the request's inbox and goes on with the batch.
A client that stops reading fills, in turn, the kernel's socket buffers and the server's write buffer (uvicorn's
flow control: 64 KiB), and then the stream's next write waits. Once a write has waited ``STALL_SECONDS`` the stream
is cut: the connection is aborted (its unsent bytes dropped: a plain close would wait for the client to read them),
so the app sees the client gone (``http.disconnect``) as for a real disconnect, which ends the stream and cancels
the request in the engine at its next step (its slot and KV cache freed); later writes are dropped. A client that
reads slowly but keeps reading is never cut: only a write that cannot start counts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
STALL_SECONDS = 30.0


class StalledReaderCut:
    """ASGI middleware: cut an HTTP response whose next body write has waited ``stall_seconds`` (default
    ``STALL_SECONDS``) for a client that stopped reading."""

    def __init__(self, app: Callable, stall_seconds: float | None = None) -> None:
        self.app = app
        self.stall_seconds = stall_seconds

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stall = STALL_SECONDS if self.stall_seconds is None else self.stall_seconds
        cut = False

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal cut
            if cut:
                return  # dropped: the connection is gone
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                async with asyncio.timeout(stall):
                    await send(message)  # waits before writing anything while the write buffer is full
            except TimeoutError:
                client = scope.get("client") or ("?", 0)
                log.warning("a client (%s:%s) stopped reading its stream for %g s: cut", *client[:2], stall)
                cut = True
                _abort(receive)

        await self.app(scope, receive, guarded_send)


def _abort(receive: Callable) -> None:
    """Abort the connection under ``receive``: uvicorn's is a method of the request's cycle, which holds the asyncio
    transport (the ASGI interface offers no way to drop a connection with unsent data). Under another server
    (Ray Serve's proxy) the writes are only dropped: the request runs to its end, holding no more memory."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    abort = getattr(transport, "abort", None)
    if callable(abort):
        abort()
