"""The prompts whose answers train-head holds out of a make-data run (the first 32 ShareGPT prompts, Spec-Bench
excluded, in make-data's order), as a Spec-Bench-style JSONL: generation on the prompts the head's held-out
figures come from.

    .venv/bin/python recipes/sharegpt_held_out.py OUT.jsonl [--count 32]
"""

from __future__ import annotations

import argparse
import json

from specdecode.training.answers import AnswerSettings, AnswerStats, training_prompts
from specdecode.training.data import HELD_OUT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=HELD_OUT)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as file:
        for index, question in training_prompts(AnswerSettings(limit=args.count), AnswerStats()):
            record = {"question_id": index, "category": "sharegpt_held_out", "turns": [question]}
            file.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
