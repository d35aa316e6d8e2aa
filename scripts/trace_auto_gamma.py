"""Trace ``gamma="auto"`` round by round on a prompt file: per prompt, the γ chosen each round, the controller's
first-position acceptance estimate a_1, v(2) and the drafting cost c as it saw them (and the 1- and 2-token
forward times they come from, in ms), then plain, γ auto and γ1
timed (best of ``--repeats``, each decoder fresh per prompt as the bench builds them, built untimed).

    .venv/bin/python scripts/trace_auto_gamma.py docs/bench/eagle/unseen_chat.jsonl [--limit 10] \
        [--proposer eagle] [--head DIR]

Greedy (or exact sampling at ``--temperature``, seed 0), 128 new tokens, 2 threads; the decisions are printed
every ``--every`` rounds.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

import specdecode as sd
from specdecode.adaptive import AdaptiveGamma
from specdecode.bench.workloads import build_prompt
from specdecode.factory import build_proposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--proposer", default="eagle", help="lookup, eagle (the shipped head, a chain), ...")
    parser.add_argument("--head", default=None, help="an EAGLE head folder (default: the shipped one)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: exact sampling, seed 0")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = sd.load_model("smollm2")
    proposer = build_proposer(args.proposer, target, None, head=args.head, tree_nodes=0)
    params = sd.SamplingParams(temperature=args.temperature, max_new_tokens=args.tokens, seed=0)
    rounds: list[tuple[int, float, float, float, float, float]] = []
    choose = AdaptiveGamma.choose

    def traced(self: AdaptiveGamma) -> int:
        gamma = choose(self)
        costs = self.costs
        step, two = costs.step_seconds or 0.0, costs.verify_seconds.get(2, 0.0)
        rounds.append((gamma, self.acceptance()[0], costs.verify_cost(2), costs.draft_cost(), 1e3 * step, 1e3 * two))
        return gamma

    AdaptiveGamma.choose = traced  # type: ignore[method-assign]
    items = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][: args.limit]
    if not items:
        parser.error(f"no prompts in {args.prompts}")
    totals: dict[str, float] = collections.defaultdict(float)
    for item in items:
        ids = build_prompt(target, item["turns"][:1], [])
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, gamma in (("plain", None), ("auto", "auto"), ("γ1", 1)):
                if gamma is None:
                    runner = target.new_runner()
                    started = time.perf_counter()
                    sd.autoregressive_generate(target, ids, params, runner=runner)
                else:
                    decoder = sd.SpeculativeDecoder(target, proposer, gamma=gamma)
                    decoder._runner  # allocated untimed, as the bench's start() does  # noqa: B018
                    rounds.clear()
                    started = time.perf_counter()
                    decoder.generate(ids, params)
                    if gamma == "auto":
                        trace = list(rounds)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)
        for name, seconds in best.items():
            totals[name] += seconds
        chosen = dict(sorted(collections.Counter(g for g, *_ in trace).items()))
        print(f"{item.get('question_id')}: " + ", ".join(f"{n} {s * 1000:.0f} ms" for n, s in best.items()), chosen)
        print("  γ  ", "".join(str(g) for g, *_ in trace))
        for label, column in (("a_1", 1), ("v(2)", 2), ("c", 3), ("t1ms", 4), ("t2ms", 5)):
            print(f"  {label:4}", " ".join(f"{r[column]:.2f}" for r in trace[:: args.every]))
    print(
        "total: "
        + ", ".join(f"{n} {s:.2f} s" for n, s in totals.items())
        + f"; auto {totals['plain'] / totals['auto']:.3f}× plain, γ1 {totals['plain'] / totals['γ1']:.3f}×"
    )


if __name__ == "__main__":
    main()
