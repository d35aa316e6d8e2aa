"""The OpenMP pool release the serving engine relies on (its speed is bench-serve's to show, not a test's)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode import openmp
from specdecode.serving.batching import scheduler as scheduler_module


def test_the_pool_is_released_where_torch_runs_on_gnu_openmp():
    on_gomp = "parallel backend: OpenMP" in torch.__config__.parallel_info() and any(
        (Path(torch.__file__).parent / "lib").glob("libgomp*.so*")
    )
    x = torch.ones(200_000)
    before = x * 3  # parallel work on this thread: its pool exists
    assert openmp.release_thread_pool() is on_gomp
    assert torch.equal(x * 3, before)  # parallel work after a release runs as before (the pool comes back)


def test_starting_the_engine_releases_the_starting_threads_pool(monkeypatch):
    calls = []
    monkeypatch.setattr(scheduler_module, "release_thread_pool", lambda: calls.append(1) or True)

    class Thread:
        def start(self):
            calls.append(2)

    engine = scheduler_module.Scheduler.__new__(scheduler_module.Scheduler)
    engine._thread = Thread()
    engine.start()
    assert calls == [1, 2]  # released before the engine thread starts
