"""The verify-cost curve v(k): forward time of k new tokens on a warm cache, relative to k = 1."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

from ..models.loader import LoadedModel


def relative_curve(medians: dict[int, float]) -> dict[int, float]:
    """v(k) = median seconds at k / median seconds at k = 1."""
    if medians.get(1, 0.0) <= 0.0:
        raise ValueError("the curve needs a positive k = 1 timing")
    return {k: medians[k] / medians[1] for k in sorted(medians)}


def measure_verify_cost(
    target: LoadedModel,
    max_k: int = 32,
    context: int = 500,
    repeats: int = 5,
    seed: int = 0,
    on_step: Callable[[], None] | None = None,
) -> dict[int, float]:
    """Median forward time for k = 1..max_k new tokens on a ``context``-token cache, relative to k = 1.

    One untimed warm-up sweep, then ``repeats`` sweeps over k in a shuffled order (so drift in the
    machine's speed spreads over every k); the cache is rolled back to ``context`` after each forward.
    """
    limit = getattr(target.model.config.get_text_config(), "max_position_embeddings", None)
    if limit:
        context = max(1, min(context, limit - max_k))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (context + max_k,), generator=generator)
    runner = target.new_runner()
    runner.prefill(tokens[:context])
    order = list(range(1, max_k + 1))
    rng = random.Random(seed)
    timings: dict[int, list[float]] = {k: [] for k in order}
    for sweep in range(repeats + 1):
        rng.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            runner.forward(tokens[context : context + k])
            elapsed = time.perf_counter() - t0
            runner.rollback_to(context)
            if sweep:
                timings[k].append(elapsed)
        if on_step is not None:
            on_step()
    return relative_curve({k: statistics.median(ts) for k, ts in timings.items()})
