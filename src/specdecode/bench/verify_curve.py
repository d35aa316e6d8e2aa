"""The verify-cost curve v(k): forward time of k new tokens on a warm cache, relative to k = 1."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.loaded import LoadedModel


def relative_curve(medians: dict[int, float]) -> dict[int, float]:
    """v(k) = median seconds at k / median seconds at k = 1."""
    if medians.get(1, 0.0) <= 0.0:
        raise ValueError("the curve needs a positive k = 1 timing")
    return {k: medians[k] / medians[1] for k in sorted(medians)}


Forward = Callable[[list[int]], None]  # appends k token ids to a warm cache, then rolls back


@dataclass(frozen=True)
class VerifyCurves:
    """Median milliseconds of a k-token forward per engine (``ours``, and peers such as ``llama.cpp``), k = 1.."""

    milliseconds: dict[str, dict[int, float]]

    def relative(self, engine: str = "ours") -> dict[int, float]:
        """v(k) for ``engine``."""
        return relative_curve(self.milliseconds[engine])


def measure_verify_curves(
    target: LoadedModel,
    max_k: int = 32,
    context: int = 500,
    repeats: int = 5,
    seed: int = 0,
    on_step: Callable[[], None] | None = None,
    peers: dict[str, Callable[[list[int]], Forward]] | None = None,
) -> VerifyCurves:
    """Forward times for k = 1..max_k new tokens on a ``context``-token cache: ours and each peer's, interleaved.

    ``peers`` maps a name to a factory that, given the context's token ids, returns the peer's forward. One
    untimed warm-up sweep, then ``repeats`` sweeps over k in a shuffled order, each engine in turn at each k (so
    drift in the machine's speed spreads over every k and engine).
    """
    limit = getattr(target.model.config.get_text_config(), "max_position_embeddings", None)
    if limit:
        context = max(1, min(context, limit - max_k))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (context + max_k,), generator=generator)
    runner = target.new_runner()
    runner.prefill(tokens[:context])

    def ours(new: list[int]) -> None:
        runner.forward(torch.tensor(new))
        runner.rollback_to(context)

    forwards: dict[str, Forward] = {"ours": ours}
    for name, make in (peers or {}).items():
        forwards[name] = make(tokens[:context].tolist())
    order = list(range(1, max_k + 1))
    rng = random.Random(seed)
    timings: dict[str, dict[int, list[float]]] = {name: {k: [] for k in order} for name in forwards}
    for sweep in range(repeats + 1):
        rng.shuffle(order)
        for k in order:
            new = tokens[context : context + k].tolist()
            for name, forward in forwards.items():
                t0 = time.perf_counter()
                forward(new)
                elapsed = time.perf_counter() - t0
                if sweep:
                    timings[name][k].append(elapsed)
        if on_step is not None:
            on_step()
    return VerifyCurves(
        {name: {k: statistics.median(ts) * 1e3 for k, ts in per_k.items()} for name, per_k in timings.items()}
    )


def measure_verify_cost(
    target: LoadedModel,
    max_k: int = 32,
    context: int = 500,
    repeats: int = 5,
    seed: int = 0,
    on_step: Callable[[], None] | None = None,
) -> dict[int, float]:
    """Our v(k), k = 1..max_k, on a ``context``-token cache (see ``measure_verify_curves``)."""
    return measure_verify_curves(target, max_k, context, repeats, seed, on_step).relative()
