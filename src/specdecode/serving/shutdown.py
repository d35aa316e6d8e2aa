"""Serving until Ctrl+C or SIGTERM, then stopping cleanly: no new request is accepted, those running get a grace
period to finish, the rest end with what they have (``finish_reason`` length and their final chunk), the suffix
history is written, and the process exits 0 with one line, no traceback.

uvicorn alone does part of this: on a signal it stops listening and waits for open connections, but then cancels
the streams still running at its own timeout (a traceback each) and, once stopped, raises the captured SIGINT
again (a KeyboardInterrupt traceback, exit 130; SIGTERM: killed, exit 143). Here the signal also starts the
engine's grace period (``Scheduler.close``), so every stream ends on its own before uvicorn's timeout, and the
signal is not raised again.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

from . import stalls
from .app import create_app
from .server import Server

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# uvicorn's own wait for open connections, past the grace period and the stall bound: the engine's last step, the
# final chunks.
CLOSE_MARGIN_SECONDS = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, calling ``on_signal(name)`` at the first Ctrl+C or SIGTERM and never raising the signal
    again once stopped (a second Ctrl+C still stops at once, as uvicorn's does)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[str], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.signal_name: str | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(sig).name
            self.on_signal(self.signal_name)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve_until_signalled(server: Server, host: str, port: int, grace: float, **uvicorn_options: Any) -> str:
    """Serve ``server`` on ``host:port`` until a signal, stop as the module says, print the closing line on stderr
    and return it."""
    scheduler = server.scheduler
    config = uvicorn.Config(
        create_app(server),
        host=host,
        port=port,
        log_level="info",
        # past the grace period, a client that stopped reading is cut (stalls.py) before uvicorn would cancel it
        timeout_graceful_shutdown=grace + stalls.STALL_SECONDS + CLOSE_MARGIN_SECONDS,
        **uvicorn_options,
    )
    at_signal: list[tuple[float, int]] = []  # when, and how many requests were in the engine

    def on_signal(name: str) -> None:
        status = scheduler.status()
        at_signal.append((time.monotonic(), int(status["running"]) + int(status["waiting"])))
        scheduler.close(grace)

    runner = GracefulServer(config, on_signal)
    runner.run()
    if scheduler.alive:  # a second Ctrl+C skipped the app's shutdown: end the requests, keep the history
        scheduler.stop()
        server.save_history()
    since, running = at_signal[0] if at_signal else (time.monotonic(), 0)
    line = (
        f"specdecode: stopped on {runner.signal_name or 'request'} in {time.monotonic() - since:.1f} s; of the "
        f"{running} requests running then, {max(0, running - scheduler.cut)} finished and {scheduler.cut} were cut at "
        f"the {grace:g} s grace period (finish_reason length)"
    )
    if server.suffix is not None and server.config.suffix_cache and server.config.suffix_scope == "global":
        line += f"; suffix history saved to {server.config.suffix_cache}"
    print(line, file=sys.stderr, flush=True)
    return line
