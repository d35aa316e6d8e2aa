"""One OpenMP thread pool at a time: freeing the calling thread's pool before another thread takes over the work.

torch's CPU build runs its parallel regions (``at::parallel_for``, which our kernels use too) on GNU OpenMP, which
keeps a worker pool per host thread that ever entered one. Once a second thread has its own pool, libgomp manages
more threads than there are CPUs and throttles its workers' spinning: every parallel region then pays a futex
wake-up. Measured on 2 cores: a SmolLM2 forward took 3.4 ms on the main thread and 10.3 ms on a thread started
after the main thread had loaded the model (an elementwise op: 8 against 48 µs); after the main thread's pool is
freed the new thread runs as fast as the main one did. ``omp_pause_resource_all(omp_pause_soft)`` (OpenMP 5.0)
frees it; the pool comes back if that thread runs parallel work again.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

OMP_PAUSE_SOFT = 1


@functools.cache
def _pause():
    """``omp_pause_resource_all`` of the OpenMP runtime torch loaded, or None where there is none to call."""
    import torch

    candidates = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    for library in [None, *map(str, candidates)]:  # None: the symbols already loaded into the process
        try:
            function = ctypes.CDLL(library).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
        return function
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (call it before handing torch work to another thread); False
    where torch's OpenMP runtime has no ``omp_pause_resource_all`` (nothing done)."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
