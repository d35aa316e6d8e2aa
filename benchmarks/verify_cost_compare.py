"""v(k) of several weight settings or kernel builds of the bundled SmolLM2, interleaved in one process.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/verify_cost_compare.py --settings gguf,gguf-a8
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/verify_cost_compare.py --kernels native,avx2

Each setting is loaded once (``--kernels`` picks the build of the compiled kernels, as SPECDECODE_KERNELS does);
then k new tokens on a ``--context``-token cache, sweeps in a shuffled order, every setting in turn at each k,
medians. Prints a markdown table of milliseconds and v(k) = t(k) / t(1) per setting, and whether the settings'
logits are bitwise equal (expected for kernel builds, not for different weight settings).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

import specdecode as sd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", default="gguf", help="comma list of --quantization settings")
    parser.add_argument("--kernels", default="native", help="comma list of kernel builds: native, avx2, portable")
    parser.add_argument("--ks", default="1,2,3,4,5,6,8,12,16,32")
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--sweeps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runners = {}
    ks = [int(k) for k in args.ks.split(",")]
    tokens = torch.randint(0, 49152, (args.context + max(ks),), generator=torch.Generator().manual_seed(0))
    for build in args.kernels.split(","):
        os.environ["SPECDECODE_KERNELS"] = build
        for setting in args.settings.split(","):
            runner = sd.load_model("smollm2", quantization=setting).new_runner()
            runner.prefill(tokens[: args.context])
            runners[f"{setting}, {build}"] = runner
    timings = {(name, k): [] for name in runners for k in ks}
    order, rng = list(ks), random.Random(0)
    for sweep in range(args.sweeps + 1):  # the first sweep warms up
        rng.shuffle(order)
        for k in order:
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.forward(tokens[args.context : args.context + k])
                elapsed = time.perf_counter() - start
                runner.rollback_to(args.context)
                if sweep:
                    timings[(name, k)].append(elapsed)
    ms = {key: statistics.median(values) * 1e3 for key, values in timings.items()}
    print("| k | " + " | ".join(map(str, ks)) + " |")
    print("| --- |" + " --- |" * len(ks))
    for name in runners:
        print(f"| {name}, ms | " + " | ".join(f"{ms[(name, k)]:.2f}" for k in ks) + " |")
        print(f"| {name}, v(k) | " + " | ".join(f"{ms[(name, k)] / ms[(name, 1)]:.2f}" for k in ks) + " |")
    logits = [runner.forward(tokens[args.context : args.context + 4]) for runner in runners.values()]
    print("logits bitwise equal across settings:", all(torch.equal(logits[0], other) for other in logits[1:]))


if __name__ == "__main__":
    main()
