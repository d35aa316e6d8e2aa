"""Questions written by the target itself, for make-data (the "pre-query template" idea of Magpie, Xu et al. 2024):
the chat template up to where the user's text would begin, sampled at a temperature until the turn ends. An
instruct model then writes the kind of question it was tuned to answer, a prompt distribution unlike ShareGPT's
(long pastes, code) and closer to a chat user's.

    .venv/bin/python scripts/self_questions.py --count 1500 --out questions.jsonl [--temperature 1.0] [--seed 0]

Sample i is drawn with seed + i (the same file on every run); a run appends to --out and resumes after the last
sample there. Kept: 4–120 words, not a repeat, not a Spec-Bench question. Each line is a chat of a user turn
alone: ``make-data --prompts questions.jsonl`` answers them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

import specdecode as sd
from specdecode.heads.data import normalise, spec_bench_questions

PROBE = "\x00PROBE\x00"


def pre_query_ids(target: sd.LoadedModel) -> list[int]:
    """The chat template's ids before a user turn's text: the render of a probe user turn, cut at the probe."""
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": PROBE}], tokenize=False)
    return target.encode(text[: text.index(PROBE)])


def kept(question: str, key: str, seen: set[str], spec_bench: frozenset[str]) -> bool:
    """A question of 4–120 words whose normalised ``key`` is neither a repeat nor a Spec-Bench question."""
    return 4 <= len(question.split()) <= 120 and key not in seen and key not in spec_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, required=True, help="questions to keep")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--spec-bench", help="Spec-Bench question.jsonl (default: the project's copy)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = sd.load_model(args.target)
    prefix = pre_query_ids(target)
    spec_bench = spec_bench_questions(args.spec_bench) or frozenset()
    rows = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    seen = {normalise(r["messages"][0]["content"]) for r in rows}
    tried = max((r["seed"] - args.seed + 1 for r in rows), default=0)
    runner = target.new_runner()
    with args.out.open("a") as out, tqdm(total=args.count, initial=len(rows), unit="question") as bar:
        while len(seen) < args.count:
            seed = args.seed + tried
            tried += 1
            params = sd.SamplingParams(
                temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=seed
            )
            result = sd.autoregressive_generate(target, prefix, params, runner=runner)
            question = result.text.strip()
            key = normalise(question)
            if result.finish_reason != "eos" or not kept(question, key, seen, spec_bench):
                continue
            seen.add(key)
            out.write(json.dumps({"messages": [{"role": "user", "content": question}], "seed": seed}) + "\n")
            out.flush()
            bar.update(1)
    print(f"{len(seen)} questions in {args.out} from {tried} samples")


if __name__ == "__main__":
    main()
