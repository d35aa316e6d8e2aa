"""Time one-row and four-row forwards of the native runner over caches of 128 to 4,096 tokens, with the kernels'
phase split: how a decode step and a verify pass grow with the context.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_context_time.py [--target smollm2|gemma3-270m]

Random prompt ids (seed 0), five warm-up forwards per cache, then medians of 30 forwards in ms, each rolled back.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from profile_runner import KERNEL_PHASES  # benchmarks/ is on the path when a script there runs

import specdecode as sd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--contexts", default="128,512,2048,4096")
    parser.add_argument("--rows", default="1,4")
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = sd.load_model(args.target)
    generator = torch.Generator().manual_seed(0)
    for context in (int(x) for x in args.contexts.split(",")):
        runner = loaded.new_runner()
        runner.prefill(torch.randint(0, loaded.vocab_size, (context,), generator=generator))
        kernels = runner._lm_head.handle.kernels
        for _ in range(5):
            runner.forward(torch.tensor([42]))
            runner.rollback_to(context)
        for rows in (int(x) for x in args.rows.split(",")):
            tokens = torch.randint(0, loaded.vocab_size, (rows,), generator=generator)
            kernels.profile(True)
            times = []
            for _ in range(30):
                start = time.perf_counter()
                runner.forward(tokens)
                times.append(time.perf_counter() - start)
                runner.rollback_to(context)
            seconds = kernels.profile(False)
            split = " ".join(f"{n}={s / 30 * 1e3:.2f}" for n, s in zip(KERNEL_PHASES, seconds, strict=False) if s > 0)
            print(f"cache {context}, {rows} rows: {statistics.median(times) * 1e3:.2f} ms ({split})", flush=True)


if __name__ == "__main__":
    main()
