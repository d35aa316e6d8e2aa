"""Time a bundled model's first load (building its dense copy from the GGUF), with and without
``faster_transformers_gguf``, each into a fresh cache folder, and check the two folders are byte for byte the same.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/first_load_time.py [--target smollm2|gemma3-270m] [--rounds 2]

Each build runs in its own process (the order alternates by round); the table prints seconds per build.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import contextlib, sys, time
import specdecode.models.gguf_speedups as speedups
from specdecode.models import loader
from specdecode.models.bundled import BUNDLED
if sys.argv[2] == "off":
    speedups.faster_transformers_gguf = contextlib.nullcontext
start = time.perf_counter()
loader._dense_cache(BUNDLED[sys.argv[1]].gguf_path())
print(time.perf_counter() - start)
"""


def build(target: str, mode: str, cache: Path) -> float:
    env = {**os.environ, "SPECDECODE_CACHE": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, target, mode], env=env, check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def same_folders(a: Path, b: Path) -> bool:
    names = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    if names != sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"off": [], "on": []}
    same = []
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            folders = {}
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                cache = Path(root) / f"{mode}{r}"
                start = time.perf_counter()
                times[mode].append(build(args.target, mode, cache))
                print(f"round {r} {mode}: {times[mode][-1]:.1f} s (process {time.perf_counter() - start:.1f} s)")
                folders[mode] = next((cache / "dense").iterdir())
            same.append(same_folders(folders["off"], folders["on"]))
    summary = {mode: round(statistics.median(t), 1) for mode, t in times.items()}
    print(json.dumps({"target": args.target, "median_s": summary, "folders_identical": same}))


if __name__ == "__main__":
    main()
