"""A/B the kernels' attention between versions of their C++ sources, in one process, over a model-sized KV cache.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/attention_ab.py OLD.cpp NEW.cpp [...] [--reps 25] [--shape 1.7b]

Each source is compiled as the runner's native build would be, under a namespace of its own, so all load side by
side; each case then calls ``attention`` over every layer of a model-shaped cache (``--shape``: SmolLM2-135M's 30
layers of 9 query heads and 3 key/value heads, or SmolLM2-1.7B's 24 layers of 32 and 32; head size 64; more than
the L3 holds, as in a decode step), the versions in alternating order per repetition; medians in ms after 3
warm-up repetitions. Every version's output must equal the first's bit for bit.
Each SOURCE is a version's ops.cpp, beside its other parts (``git archive HEAD src/specdecode/kernels/csrc | tar -x
-C /tmp/old`` for the committed version), or the single kernels.cpp of a version from before the split.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdecode import kernels

SHAPES = {"135m": (9, 3, 64, 30), "1.7b": (32, 32, 64, 24)}  # query heads, key/value heads, head size, layers
CAPACITY = 4224
CASES = {  # (cached keys, rows); the 1.7B's cache is 8x the 135M's a key
    "135m": ((512, 1), (1024, 1), (2048, 1), (4096, 1), (2048, 4), (4096, 4), (500, 9)),
    "1.7b": ((300, 1), (500, 1), (900, 1), (2048, 1), (500, 5), (500, 9)),
}


def build(source: Path, name: str, folder: Path):
    """``torch.ops.<name>``: ``source`` compiled with the native build's command, under namespace ``name``."""
    library = folder / f"{name}.so"
    command = kernels._command("native", library)
    command = [str(source) if part == str(kernels.SOURCE) else part for part in command]
    command = [f"-DSD_NS={name}" if part.startswith("-DSD_NS=") else part for part in command]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{source}: g++ failed\n{result.stderr[-2000:]}")
    torch.ops.load_library(str(library))
    return getattr(torch.ops, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    args = parser.parse_args()
    heads, kv_heads, dim, layers = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        versions = {str(s): build(s, f"sd_attention_ab_{i}", Path(tmp)) for i, s in enumerate(args.sources)}
        generator = torch.Generator().manual_seed(0)
        keys = [torch.randn(layers, kv_heads, CAPACITY // 16, dim, 16, generator=generator).half()]
        values = [torch.randn(layers, kv_heads, CAPACITY, dim, generator=generator).half()]
        names = list(versions)
        for cached, rows in CASES[args.shape]:
            meta = torch.tensor([[0, cached + i, cached + i, cached + i + 1] for i in range(rows)], dtype=torch.int32)
            q = torch.randn(rows, heads, dim, generator=generator)
            extras = (torch.zeros(rows + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))

            def call(ops, layer: int, q=q, meta=meta, extras=extras) -> torch.Tensor:
                return ops.attention(q, keys, values, meta, *extras, layer, heads, kv_heads, dim**-0.5)

            first = call(versions[names[0]], 3)
            for name in names[1:]:
                if not torch.equal(call(versions[name], 3), first):
                    raise SystemExit(f"{name} differs from {names[0]} at {cached} keys x {rows} rows")
            times: dict[str, list[float]] = {name: [] for name in names}
            for rep in range(args.reps + 3):
                for name in names if rep % 2 == 0 else names[::-1]:
                    start = time.perf_counter()
                    for layer in range(layers):
                        call(versions[name], layer)
                    if rep >= 3:
                        times[name].append(time.perf_counter() - start)
            cells = " | ".join(f"{statistics.median(times[n]) * 1e3:.2f}" for n in names)
            print(f"{cached} keys x {rows} rows: {cells} ms", flush=True)
        print("columns: " + ", ".join(names))


if __name__ == "__main__":
    main()
