"""Would drafting only where the EAGLE head is confident pay? Replays greedy rounds on ``chain_confidence.py``
records: a round drafts guess d while the product of the head's probabilities for guesses 1..d stays >= tau (at
most --max-depth guesses; the probabilities are known before each guess is made, so the rule is exact in sampling
too when it reads the law's top probability), and accepts the guesses' longest run matching the target's answer.
Greedy output is fixed, so the replay's acceptance is what generation would see.

    python scripts/replay_confidence_gate.py REC.json [REC.json ...] --v 1.10,1.22,1.33,1.57 --sync 0.13 --step 0.06

Costs are in plain steps: --v the target's pass over 2, 3, ... rows against one row (v(k) of
``scripts/verify_cost_compare.py``), --sync the head's catch-up and first guess (paid every round: its logits
decide whether to draft at all), --step each further head step. Prints tokens a round and the predicted speed
against plain decoding for fixed chains and for each (max depth, tau), and the head's calibration at depth 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def replay(records: dict, v: list[float], sync: float, step: float, max_depth: int, tau: float | None) -> dict:
    """Greedy rounds over every record; ``tau`` None drafts a fixed chain of ``max_depth``."""
    tokens = cost = rounds = drafted = 0
    for record in records.values():
        answer, guesses = record["answer"], record["guesses"]
        i = 0
        while i < len(answer):
            chain = guesses[i]
            if tau is None:
                length, steps = max_depth, max_depth - 1
            else:
                length, product = 0, 1.0
                for _, prob in chain[:max_depth]:
                    product *= prob
                    if product < tau:
                        break
                    length += 1
                steps = min(length, max_depth - 1)  # the step after the last guess drafted, if it was looked at
            length = min(length, len(answer) - i - 1)
            accepted = 0
            while accepted < length and chain[accepted][0] == answer[i + accepted]:
                accepted += 1
            tokens += accepted + 1
            cost += (1.0 if length == 0 else v[length - 1]) + sync + step * steps
            rounds += 1
            drafted += length
            i += accepted + 1
    return {"tokens_per_round": tokens / rounds, "speed": tokens / cost, "drafted_per_round": drafted / rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+")
    parser.add_argument("--v", required=True, help="v(2), v(3), ...: a pass over k rows against one row")
    parser.add_argument("--sync", type=float, required=True)
    parser.add_argument("--step", type=float, required=True)
    parser.add_argument("--taus", default="0.1,0.2,0.3,0.4,0.5")
    args = parser.parse_args()
    records: dict = {}
    for path in args.records:
        records.update(json.loads(path.read_text()))
    v = [float(x) for x in args.v.split(",")]
    depths = range(1, min(len(v), len(next(iter(records.values()))["guesses"][0])) + 1)
    print("| drafting | tokens a round | guesses a round | predicted × plain |\n| --- | --- | --- | --- |")
    for depth in depths:
        r = replay(records, v, args.sync, args.step, depth, None)
        print(f"| chain γ{depth} | {r['tokens_per_round']:.3f} | {depth} | {r['speed']:.3f} |")
    for depth in depths:
        for tau in (float(t) for t in args.taus.split(",")):
            r = replay(records, v, args.sync, args.step, depth, tau)
            print(
                f"| ≤ {depth}, while Π p ≥ {tau} | {r['tokens_per_round']:.3f} | {r['drafted_per_round']:.2f} "
                f"| {r['speed']:.3f} |"
            )
    edges = [i / 10 for i in range(11)]
    bins = [[0, 0] for _ in range(10)]
    for record in records.values():
        for chain, token in zip(record["guesses"], record["answer"], strict=False):
            b = min(int(chain[0][1] * 10), 9)
            bins[b][0] += 1
            bins[b][1] += chain[0][0] == token
    print("\n| head's probability for its first guess | positions | accepted |\n| --- | --- | --- |")
    for b, (n, hit) in enumerate(bins):
        print(f"| {edges[b]:.1f}–{edges[b + 1]:.1f} | {n} | {hit / max(1, n):.0%} |")


if __name__ == "__main__":
    main()
