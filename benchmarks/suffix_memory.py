"""Memory, append and drafting cost of a suffix history of ~1.1 M tokens (the stdlib's .py files, SmolLM2's
tokenizer), for docs/BENCHMARKS.md ("Suffix decoding").

    python benchmarks/suffix_memory.py [TOKENS]
"""

from __future__ import annotations

import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

import specdecode as sd
from specdecode.proposers import SuffixHistory, SuffixProposer


def main() -> None:
    wanted = int(sys.argv[1]) if len(sys.argv) > 1 else 1_100_000
    tokenizer = sd.load_model("smollm2").tokenizer
    documents, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        ids = tokenizer(path.read_text(errors="ignore"))["input_ids"]
        documents.append(ids)
        total += len(ids)
        if total >= wanted:
            break
    history = SuffixHistory(max_tokens=10 * wanted)
    start = time.perf_counter()
    for ids in documents:
        history.add(ids)
    seconds = time.perf_counter() - start
    per_token = seconds / len(history) * 1e6
    print(f"{len(history):,} tokens in {len(documents)} documents: added at {per_token:.2f} µs/token")
    print(f"memory {history.nbytes / 2**20:.1f} MiB = {history.nbytes / len(history):.1f} bytes per token")
    proposer = SuffixProposer(history, remember=False)
    params, generator, rng, times = sd.SamplingParams(), torch.Generator(), random.Random(0), []
    long_documents = [ids for ids in documents if len(ids) >= 300]
    for _ in range(300):
        ids = rng.choice(long_documents)
        cut = rng.randrange(100, len(ids) - 50)
        proposer.end_request([])
        proposer.propose(ids[:cut], 8, params, generator)  # indexes the request
        begin = time.perf_counter()
        proposer.propose(ids[: cut + 3], 8, params, generator)
        times.append(time.perf_counter() - begin)
    times.sort()
    print(f"drafting: median {statistics.median(times) * 1e6:.0f} µs, p90 {times[int(0.9 * len(times))] * 1e6:.0f} µs")
    with tempfile.TemporaryDirectory() as folder:
        history.save(Path(folder) / "history.bin")
        begin = time.perf_counter()
        SuffixHistory.load(Path(folder) / "history.bin")
        print(f"loading: {time.perf_counter() - begin:.1f} s")


if __name__ == "__main__":
    main()
