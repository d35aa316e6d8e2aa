"""Trace ``gamma="auto"`` on one decoder across a prompt file's questions (every turn, later turns seeing the
decoder's own answers, a fresh EAGLE proposer per question — as ``specdecode bench`` runs it), exact sampling:
per turn the rounds and how many drafted, and for a turn that drafted in under 80% of its rounds the γ chosen each
round with the controller's a_1, v(2), c and its 1- and 2-token times (ms), every third round.

    .venv/bin/python scripts/trace_auto_gamma_warm.py ../shared/data/spec_bench/question.jsonl \
        [--categories writing,roleplay] [--limit 10] [--temperature 0.8] [--head DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import specdecode as sd
from specdecode.adaptive import AdaptiveGamma
from specdecode.bench.workloads import build_prompt
from specdecode.proposers.eagle import EagleProposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--categories", default="writing", help="comma-separated (default: mt_bench's first)")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--head", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = sd.load_model("smollm2")
    rows: list[tuple[int, float, float, float, float, float]] = []
    choose = AdaptiveGamma.choose

    def traced(self: AdaptiveGamma) -> int:
        gamma = choose(self)
        c = self.costs
        step, two = 1e3 * (c.step_seconds or 0.0), 1e3 * c.verify_seconds.get(2, 0.0)
        rows.append((gamma, self.acceptance()[0], c.verify_cost(2), c.draft_cost(), step, two))
        return gamma

    AdaptiveGamma.choose = traced  # type: ignore[method-assign]
    wanted = set(args.categories.split(","))
    items = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    items = [item for item in items if item.get("category") in wanted][: args.limit]
    decoder = None
    for index, item in enumerate(items):
        proposer = EagleProposer(target, head=args.head)
        if decoder is None:
            decoder = sd.SpeculativeDecoder(target, proposer, gamma="auto")
        else:
            decoder.use_proposer(proposer)
        answers: list[list[int]] = []
        for turn in range(len(item["turns"])):
            rows.clear()
            params = sd.SamplingParams(temperature=args.temperature, max_new_tokens=128, seed=index)
            out = decoder.generate(build_prompt(target, item["turns"], answers), params)
            answers.append(out.token_ids)
            drafted = sum(1 for r in rows if r[0] > 0)
            print(f"q{item['question_id']} turn {turn + 1}: {len(rows)} rounds, {drafted} drafted, "
                  f"accepted {out.stats.accepted}/{out.stats.drafted}")  # fmt: skip
            if drafted < 0.8 * len(rows):
                print("   γ   ", "".join(str(r[0]) for r in rows))
                for label, column in (("a1", 1), ("v2", 2), ("c", 3), ("t1", 4), ("t2", 5)):
                    print(f"   {label:4}", " ".join(f"{r[column]:.2f}" for r in rows[::3]))


if __name__ == "__main__":
    main()
