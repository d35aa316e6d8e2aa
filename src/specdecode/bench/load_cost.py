"""What a GGUF file costs to load and to run: load time, peak memory and disk written (a first load into a fresh
cache, then a later one), a 500-token prefill, the one-token step over 500 cached tokens and v(k) — ours next to
llama.cpp's on the same file, each load in its own process, the engines alternated round by round.

llama.cpp runs where an interpreter with llama-cpp-python is given (not a dependency: it builds llama.cpp from
source). Our first load reuses the compiled kernels of the current cache (their one-time build is not a load cost).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

OURS = """
import json, sys, time
def hwm():  # this process's own peak (VmHWM): ru_maxrss also counts the parent's RSS it was forked with
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024
start = time.perf_counter()
import torch
import specdecode as sd
torch.set_num_threads(int(sys.argv[2]))
imported = time.perf_counter()
loaded = sd.load_model(sys.argv[1])
loaded_at = time.perf_counter()
rss_load = hwm()
runner = loaded.new_runner()
ids = torch.randint(0, loaded.vocab_size, (532,), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    t = time.perf_counter(); runner.prefill(ids[:500]); prefill = time.perf_counter() - t
    costs = {}
    for k in (1, 2, 4, 8):
        times = []
        for _ in range(8):
            t = time.perf_counter(); runner.forward(ids[500 : 500 + k]); times.append(time.perf_counter() - t)
            runner.rollback_to(500)
        costs[k] = sorted(times)[len(times) // 2]
peak = hwm()
print(json.dumps({"engine": "specdecode", "import_s": imported - start, "load_s": loaded_at - imported,
                  "rss_after_load_mb": rss_load, "peak_rss_mb": peak,
                  "prefill_500_s": prefill, "step_ms": 1000 * costs[1],
                  "v": {k: costs[k] / costs[1] for k in (2, 4, 8)}, "describe": loaded.describe()}))
"""

LLAMACPP = """
import json, sys, time
def hwm():  # this process's own peak (VmHWM): ru_maxrss also counts the parent's RSS it was forked with
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024
import llama_cpp
threads = int(sys.argv[2])
start = time.perf_counter()
llm = llama_cpp.Llama(sys.argv[1], n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
loaded_at = time.perf_counter()
rss_load = hwm()
import random
random.seed(0)
ids = [random.randrange(llm.n_vocab()) for _ in range(516)]
t = time.perf_counter(); llm.eval(ids[:500]); prefill = time.perf_counter() - t
times = []
for i in range(500, 516):
    t = time.perf_counter(); llm.eval([ids[i]]); times.append(time.perf_counter() - t)
print(json.dumps({"engine": "llama.cpp", "load_s": loaded_at - start, "rss_after_load_mb": rss_load,
                  "peak_rss_mb": hwm(), "prefill_500_s": prefill,
                  "step_ms": 1000 * sorted(times)[len(times) // 2]}))
"""

SUMMARY_KEYS = ("load_s", "peak_rss_mb", "disk_written_mb", "prefill_500_s", "step_ms")


def _disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and "kernels" not in p.parts)


def _run(python: str, code: str, path: Path, threads: int, env: dict[str, str]) -> dict:
    out = subprocess.run(
        [python, "-c", code, str(path), str(threads)], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measurements(llamacpp: bool, rounds: int) -> int:
    """How many processes ``compare_load`` runs: per round our first and later loads, and llama.cpp's one."""
    return rounds * (3 if llamacpp else 2)


def compare_load(
    path: Path,
    rounds: int = 2,
    threads: int = 2,
    llamacpp_python: str | None = None,
    on_result: Callable[[str, dict], None] | None = None,
) -> dict[str, list[dict]]:
    """Measure ``path`` ``rounds`` times (our first and later loads; llama.cpp's where ``llamacpp_python`` names an
    interpreter with llama-cpp-python), alternating which engine goes first; ``on_result(name, row)`` after each.
    Returns the rows by name ("specdecode, first load", "specdecode, later load", "llama.cpp")."""
    from .. import kernels
    from ..disk_cache import cache_root

    kernels.build("native")  # compiled once into the current cache; linked into each fresh one
    built = cache_root() / "kernels"
    results: dict[str, list[dict]] = {}

    def record(name: str, row: dict) -> None:
        results.setdefault(name, []).append(row)
        if on_result is not None:
            on_result(name, row)

    for round_ in range(rounds):
        order = ["ours", "llamacpp"] if round_ % 2 == 0 else ["llamacpp", "ours"]
        for engine in order:
            if engine == "llamacpp":
                if llamacpp_python:
                    record("llama.cpp", _run(llamacpp_python, LLAMACPP, path, threads, dict(os.environ)))
                continue
            cache = Path(tempfile.mkdtemp(prefix="specdecode-cache-"))
            try:
                (cache / "kernels").symlink_to(built)
                env = {**os.environ, "SPECDECODE_CACHE": str(cache)}
                for label in ("first", "later"):
                    row = _run(sys.executable, OURS, path, threads, env)
                    row["load"], row["disk_written_mb"] = label, _disk(cache) / 2**20
                    record(f"specdecode, {label} load", row)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    return results


def medians(rows: list[dict]) -> dict[str, float]:
    """The median of each summary figure the rows have, and of v(2), v(4), v(8) (``v2``, ``v4``, ``v8``)."""
    out = {k: statistics.median(r[k] for r in rows) for k in SUMMARY_KEYS if k in rows[0]}
    if "v" in rows[0]:
        out.update({f"v{k}": statistics.median(r["v"][k] for r in rows) for k in ("2", "4", "8")})
    return out


def summary(results: dict[str, list[dict]]) -> list[str]:
    """One line per engine and load: the medians over the rounds."""
    lines = []
    for name, rows in results.items():
        found = medians(rows)
        line = ", ".join(f"{k} {found[k]:.2f}" for k in SUMMARY_KEYS if k in found)
        if "v2" in found:
            line += ", v(2/4/8) " + "/".join(f"{found[f'v{k}']:.2f}" for k in "248")
        lines.append(f"{name}: {line}")
    return lines
