"""A real uvicorn server on a free loopback port, in a background thread of this process (tests, bench-serve)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from ..openmp import release_thread_pool


class LocalServer:
    """``with LocalServer(app) as server: httpx.get(server.url + "/health")`` — started and stopped cleanly."""

    def __init__(self, app: Any, host: str = "127.0.0.1", startup_timeout: float = 120.0) -> None:
        self.app = app
        self.host = host
        self.startup_timeout = startup_timeout
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind((host, 0))  # the kernel picks a free port; uvicorn serves this very socket
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> LocalServer:
        release_thread_pool()  # this thread loaded the model: its OpenMP pool would slow the engine's (openmp.py)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {self.startup_timeout:.0f} s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()
