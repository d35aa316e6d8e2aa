"""The server's batched target pass by its rows: four requests (caches of ~400-510 tokens) with their draft rows
spread as the policy spreads them, next to one request with as many rows; medians over interleaved sweeps.

What it answers: what a draft row costs a loaded server (the policy's T(rows), docs/BENCHMARKS.md), so whether a
guess accepted with probability a pays at that load: a row pays when a × (pass / requests) > its cost.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/batched_pass_rows.py [--target smollm2] [--sweeps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.factory import load
from specdecode.models.batch import forward_batch

SPREADS = {  # draft rows + 1 per request
    "4 × 1": [1, 1, 1, 1],
    "2,1,1,1": [2, 1, 1, 1],
    "2,2,1,1": [2, 2, 1, 1],
    "2,2,2,1": [2, 2, 2, 1],
    "2,2,2,2": [2, 2, 2, 2],
    "5,1,1,1": [5, 1, 1, 1],
    "3,2,2,2": [3, 2, 2, 2],
    "3,3,3,3": [3, 3, 3, 3],
}
ALONE = (1, 4, 8)  # one request with that many rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--sweeps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load(args.target, "float32")
    generator = torch.Generator().manual_seed(0)
    runners = []
    for i in range(4):
        runner = target.new_runner()
        runner.forward(torch.randint(0, 1000, (400 + 37 * i,), generator=generator))
        runners.append(runner)
    starts = [runner.length for runner in runners]

    def batched(counts: list[int]) -> float:
        tokens = [torch.randint(0, 1000, (k,), generator=generator) for k in counts]
        for runner, start in zip(runners, starts, strict=True):
            runner.rollback_to(start)
        began = time.perf_counter()
        forward_batch(runners, tokens)
        return time.perf_counter() - began

    def alone(rows: int) -> float:
        runners[0].rollback_to(starts[0])
        began = time.perf_counter()
        runners[0].forward(torch.randint(0, 1000, (rows,), generator=generator))
        return time.perf_counter() - began

    times: dict[str, list[float]] = {name: [] for name in SPREADS} | {f"1 request, {k} rows": [] for k in ALONE}
    for sweep in range(args.sweeps + 3):  # the first 3 sweeps warm up
        for name, counts in SPREADS.items():
            seconds = batched(counts)
            if sweep >= 3:
                times[name].append(seconds)
        for rows in ALONE:
            seconds = alone(rows)
            if sweep >= 3:
                times[f"1 request, {rows} rows"].append(seconds)
    print("| pass | rows | ms (median) |\n| --- | ---: | ---: |")
    for name, values in times.items():
        rows = sum(SPREADS[name]) if name in SPREADS else int(name.split(", ")[1].split()[0])
        print(f"| {name} | {rows} | {statistics.median(values) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
