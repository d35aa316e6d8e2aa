"""What a GGUF file costs to load and to run: load time, peak memory and disk written (first load into a fresh cache,
then a later one), a 500-token prefill, the one-token step over 500 cached tokens and v(k) — ours next to
llama.cpp's on the same file, each load in its own process, the engines alternated round by round.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/load_cost.py FILE.gguf [--rounds 2] [--llamacpp-python PATH]

``--llamacpp-python``: an interpreter with llama-cpp-python (not a dependency; it builds llama.cpp from source).
Our first load reuses the compiled kernels of the current cache (their one-time build is not a load cost).
Write a file in a bigger model's shape with ``scripts/synth_gguf.py``. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OURS = """
import json, resource, sys, time
start = time.perf_counter()
import torch
import specdecode as sd
torch.set_num_threads(2)
imported = time.perf_counter()
loaded = sd.load_model(sys.argv[1])
loaded_at = time.perf_counter()
rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
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
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"engine": "specdecode", "import_s": imported - start, "load_s": loaded_at - imported,
                  "rss_after_load_mb": rss_load, "peak_rss_mb": peak,
                  "prefill_500_s": prefill, "step_ms": 1000 * costs[1],
                  "v": {k: costs[k] / costs[1] for k in (2, 4, 8)}, "describe": loaded.describe()}))
"""

LLAMACPP = """
import json, resource, sys, time
import llama_cpp
start = time.perf_counter()
llm = llama_cpp.Llama(sys.argv[1], n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
loaded_at = time.perf_counter()
rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
import random
random.seed(0)
ids = [random.randrange(llm.n_vocab()) for _ in range(516)]
t = time.perf_counter(); llm.eval(ids[:500]); prefill = time.perf_counter() - t
times = []
for i in range(500, 516):
    t = time.perf_counter(); llm.eval([ids[i]]); times.append(time.perf_counter() - t)
print(json.dumps({"engine": "llama.cpp", "load_s": loaded_at - start, "rss_after_load_mb": rss_load,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "prefill_500_s": prefill,
                  "step_ms": 1000 * sorted(times)[len(times) // 2]}))
"""


def _disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and "kernels" not in p.parts)


def run(python: str, code: str, path: Path, env: dict[str, str]) -> dict:
    out = subprocess.run([python, "-c", code, str(path)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llamacpp-python", help="an interpreter with llama-cpp-python installed")
    args = parser.parse_args()
    from specdecode.models import kernels, loader

    kernels.build("native")  # compiled once into the current cache; linked into each fresh one
    built = loader.cache_root() / "kernels"
    results: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        order = ["ours", "llamacpp"] if round_ % 2 == 0 else ["llamacpp", "ours"]
        for engine in order:
            if engine == "llamacpp":
                if args.llamacpp_python:
                    found = run(args.llamacpp_python, LLAMACPP, args.gguf, dict(os.environ))
                    results.setdefault("llama.cpp", []).append(found)
                    print(json.dumps(found), flush=True)
                continue
            cache = Path(tempfile.mkdtemp(prefix="specdecode-cache-"))
            try:
                (cache / "kernels").symlink_to(built)
                env = {**os.environ, "SPECDECODE_CACHE": str(cache)}
                for label in ("first", "later"):
                    found = run(sys.executable, OURS, args.gguf, env)
                    found["load"], found["disk_written_mb"] = label, _disk(cache) / 2**20
                    results.setdefault(f"specdecode, {label} load", []).append(found)
                    print(json.dumps(found), flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    print(f"\nmedians over {args.rounds} rounds ({args.gguf.name}, {args.gguf.stat().st_size / 2**30:.2f} GiB):")
    for name, rows in results.items():
        keys = [k for k in ("load_s", "peak_rss_mb", "disk_written_mb", "prefill_500_s", "step_ms") if k in rows[0]]
        line = ", ".join(f"{k} {statistics.median(r[k] for r in rows):.2f}" for k in keys)
        if "v" in rows[0]:
            line += ", v(2/4/8) " + "/".join(f"{statistics.median(r['v'][k] for r in rows):.2f}" for k in "248")
        print(f"  {name}: {line}")


if __name__ == "__main__":
    main()
