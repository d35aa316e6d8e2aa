"""specdecode's on-disk cache (GGUF metadata and dense copies, compiled kernels, synthetic models) and the lock that
lets one process at a time build an entry of it."""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """Where the cache lives: $SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode."""
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdecode"


@contextmanager
def exclusive(lock_file: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if need be): one builder of a cache entry at a time
    across processes (two servers or test workers starting at once); released when the block ends or the
    process dies. Waiting for another process says so on stderr, naming ``what`` it builds."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"specdecode: waiting for another process to finish {what} ...", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
