"""The power of the test suite's engine-level exactness tests: for each, its law's pooled cells at its sample
size, its per-test threshold, the TV it detects with probability 0.9 (``exactness.detectable_tv``) and the
draws it would need for TV 0.05 and 0.02. No sampling: the laws are computed, the pooling depends on N only.

    .venv/bin/python benchmarks/exactness_power.py      # prints the markdown table of docs/EXACTNESS.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.models import LARGE_VOCAB, SMALL_VOCAB, tiny_llama  # noqa: E402
from test_engine import LOOKUP_PROMPT, WARPS, exact_two_token_law  # noqa: E402

import specdecode as sd  # noqa: E402
from specdecode.exactness import detectable_tv, first_token_law, pair_law, pooled_shape, samples_for_tv  # noqa: E402


def _row(name: str, law: torch.Tensor, samples: int, threshold: float) -> str:
    dof, hidden = pooled_shape(law, samples)
    tv = detectable_tv(samples, dof, threshold, hidden=hidden)
    need = [samples_for_tv(t, dof, threshold) for t in (0.05, 0.02)]
    return (
        f"| {name} | {samples:,} | {threshold:.1e} | {dof} | {hidden:.3f} | **{tv:.3f}** | {need[0]:,} | {need[1]:,} |"
    )


def main() -> None:
    small = sd.load_model(tiny_llama(SMALL_VOCAB, seed=0))
    large = sd.load_model(tiny_llama(LARGE_VOCAB, seed=10))
    t1 = sd.SamplingParams(temperature=1.0)
    rows = [
        "| test (law) | samples | threshold per test | df | hidden TV | detects TV ≥ (90%) | N for 0.05 | N for 0.02 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for warp, params in WARPS.items():  # test_engine: chains (draft model, prompt lookup), 2-token joint
        law = torch.from_numpy(np.ascontiguousarray(exact_two_token_law(small, LOOKUP_PROMPT, params).ravel()))
        rows.append(_row(f"test_engine chain, {warp}, joint of 2 tokens", law, 800, 1e-3))
    pairs = pair_law(small, [1, 2, 3], t1, 64).probs
    first = first_token_law(small, [1, 2, 3], t1)
    for name, samples, threshold in (
        ("test_tree (5 trees x 2 runners)", 800, 0.01 / 10 / 2),
        ("test_exactness (check-exact)", 800, 0.01 / 2),
    ):
        rows.append(_row(f"{name}, first token", first, samples, threshold))
        rows.append(_row(f"{name}, joint of 2 tokens", pairs, samples, threshold))
    suffix_first = first_token_law(small, [3, 9, 4], t1)
    suffix_pairs = pair_law(small, [3, 9, 4], t1, 64).probs
    rows.append(_row("test_suffix (4 cases), first token", suffix_first, 1500, 0.01 / 4 / 2))
    rows.append(_row("test_suffix (4 cases), joint of 2 tokens", suffix_pairs, 1500, 0.01 / 4 / 2))
    eagle_first = first_token_law(large, [3, 17, 5, 9], t1)
    eagle_pairs = pair_law(large, [3, 17, 5, 9], t1, 64).probs
    rows.append(_row("test_eagle (chain, tree), first token", eagle_first, 600, 1e-3 / 2))
    rows.append(_row("test_eagle (chain, tree), joint of 2 tokens", eagle_pairs, 600, 1e-3 / 2))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
