"""What a GGUF file costs to load and to run, ours next to llama.cpp's on the same file (specdecode.bench.load_cost):
load time, peak memory and disk written (first and later loads), a 500-token prefill, the step and v(k).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/load_cost.py FILE.gguf [--rounds 2] [--llamacpp-python PATH]

``--llamacpp-python``: an interpreter with llama-cpp-python (not a dependency; it builds llama.cpp from source).
Prints one JSON line per measurement, then the medians. ``specdecode bench --synthetic 1.7b,8b`` does the same on
files it writes in real models' shapes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.load_cost import compare_load, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp-python", help="an interpreter with llama-cpp-python installed")
    args = parser.parse_args()
    results = compare_load(
        args.gguf, args.rounds, args.threads, args.llamacpp_python, lambda name, row: print(json.dumps(row), flush=True)
    )
    print(f"\nmedians over {args.rounds} rounds ({args.gguf.name}, {args.gguf.stat().st_size / 2**30:.2f} GiB):")
    for line in summary(results):
        print(f"  {line}")


if __name__ == "__main__":
    main()
