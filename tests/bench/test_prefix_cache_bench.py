"""benchmarks/prefix_cache.py runs at a tiny size: both workloads, cache off and on, identical answers."""

from __future__ import annotations

from helpers.models import LARGE_VOCAB, tiny_llama

import specdecode as sd
from benchmarks import prefix_cache as bench


def test_the_benchmark_runs_tiny_and_finds_the_answers_identical():
    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=10))
    args = bench.parse(["--turns", "3", "--question-tokens", "10", "--system-tokens", "70", "--requests", "4",
                        "--max-batch", "2", "--max-new-tokens", "6", "--cache-gb", "0.01"])  # fmt: skip
    result = bench.run(target, args)
    chat, shared = result["chat"], result["shared_prompt"]
    assert chat["identical"] and shared["identical"]
    assert [t["reused"] for t in chat["off"]["turns"]] == [0, 0, 0]
    assert all(t["reused"] > 0 for t in chat["on"]["turns"][1:])
    assert shared["off"]["reused"] == 0 and shared["on"]["reused"] == 3 * 64
    assert shared["on"]["cache_bytes"] > 0
