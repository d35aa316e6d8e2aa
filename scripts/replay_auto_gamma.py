"""Replay γ ≤ 1 controllers on recorded first-guess sequences (``scripts/first_guess_sequences.py``) with fixed
costs: a plain round costs 1 step and makes one token; a γ1 round at position i costs ``--round-cost`` steps and
makes two tokens if the guess at i matched, else one. Prints speedup over plain, overall and per category, for
γ1 always, the controller choosing on the posterior mean (optimism 0) and on the shipped optimism.

    .venv/bin/python scripts/replay_auto_gamma.py docs/bench/issue17_auto2/first_guess_sequences.json \
        --round-cost 1.15 1.21 1.30

No timing and no model: the same sequences give the same figures on any machine.
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Callable
from pathlib import Path

from specdecode.adaptive import AcceptanceMemory, AdaptiveGamma, CostModel

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def replay(sequences: dict[str, list[int]], round_cost: float, make: Callable[[], AdaptiveGamma | None]) -> dict:
    """Speedup over plain per category and overall; ``make`` None: γ1 every round (a fresh controller per
    prompt, as the bench builds a decoder per question)."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for key, matched in sequences.items():
        category = key.split(":")[0]
        category = "mt_bench" if category in MT_BENCH else category
        controller = make()
        position, cost = 0, 0.0
        while position < len(matched):
            if controller is not None and min(1, controller.choose()) == 0:
                cost, position = cost + 1.0, position + 1
                continue
            accepted = matched[position]
            if controller is not None:
                controller.observe(1, accepted)
            cost, position = cost + round_cost, position + 1 + accepted
        totals[category][0] += len(matched)
        totals[category][1] += cost
    result = {name: tokens / cost for name, (tokens, cost) in totals.items()}
    result["overall"] = sum(t for t, _ in totals.values()) / sum(c for _, c in totals.values())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sequences", type=Path)
    parser.add_argument("--round-cost", type=float, nargs="+", default=[1.15, 1.21, 1.30])
    args = parser.parse_args()
    sequences = json.loads(args.sequences.read_text())
    for round_cost in args.round_cost:
        costs = CostModel(1.0, 0.05, {"": round_cost - 1.05}, fixed=True)  # v(2) = 1.05, c = the rest; never updated

        def controller(optimism: float, costs: CostModel = costs) -> AdaptiveGamma:
            return AdaptiveGamma(1, costs, AcceptanceMemory(1), optimism=optimism)

        rows = {
            "γ1 always": replay(sequences, round_cost, lambda: None),
            "auto, mean": replay(sequences, round_cost, lambda: controller(0.0)),
            "auto, shipped": replay(sequences, round_cost, lambda: controller(AdaptiveGamma.optimism)),
        }
        print(f"γ1 round = {round_cost} steps ({len(sequences)} prompts)")
        for name, result in rows.items():
            print(f"  {name:14}", " ".join(f"{k} {v:.3f}" for k, v in sorted(result.items())))


if __name__ == "__main__":
    main()
