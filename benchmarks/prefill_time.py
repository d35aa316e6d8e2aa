"""Time a prompt's prefill on the native runner at several lengths, with the compiled kernels' phase split.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/prefill_time.py [--target smollm2|gemma3-270m|FILE.gguf]
        [--lengths 512,1024,2048,4096] [--reps 3] [--split]

Random token ids (seed 0), a fresh runner per prefill, medians of ``--reps`` after one warm-up prefill. ``--split``
adds the kernels' own phase timers (matrices, attention, ...) summed over the timed prefills of each length.
Prints one JSON object: seconds per length (and the split). To compare two commits, run it from each checkout
with ``PYTHONPATH=<checkout>/src``, alternating, never two at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from profile_runner import KERNEL_PHASES  # benchmarks/ is on the path when a script there runs

import specdecode as sd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="prompt lengths in tokens")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--split", action="store_true", help="the kernels' phase timers per length")
    args = parser.parse_args()
    loaded = sd.load_model(args.target)
    runner = loaded.new_runner()
    if args.split and not getattr(runner, "uses_kernels", False):
        parser.error("--split needs the native runner on the compiled kernels")
    generator = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(0, loaded.vocab_size, (256,), generator=generator))  # warm-up
    result: dict[str, object] = {"target": args.target, "module": sd.__file__, "seconds": {}, "split": {}}
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = torch.randint(0, loaded.vocab_size, (length,), generator=generator)
        kernels = runner._lm_head.handle.kernels if args.split else None
        if kernels is not None:
            kernels.profile(True)
        times = []
        for _ in range(args.reps):
            runner = loaded.new_runner()
            start = time.perf_counter()
            runner.prefill(tokens)
            times.append(time.perf_counter() - start)
        if kernels is not None:
            seconds = kernels.profile(False)
            result["split"][length] = {
                name: round(s / args.reps, 4) for name, s in zip(KERNEL_PHASES, seconds, strict=False)
            }
        result["seconds"][length] = round(statistics.median(times), 4)
        print(f"{length} tokens: {statistics.median(times):.3f} s", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
