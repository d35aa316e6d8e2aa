"""Issue 17's ablation: a head trained on ShareGPT's text against one trained on the target's own answers to the
same prompts, at the same number of training tokens, with everything else equal.

    python scripts/compare_head_data.py --answers DIR/answers.jsonl --out DIR [--tokens N] [--epochs E]

1. ``answers.jsonl`` (from ``specdecode make-data``) is sorted by prompt index into ``own.jsonl``, so its first
   ``--held-out`` chats answer the same prompts as ShareGPT's first ones (both are read by the same reader).
2. Two heads are trained with identical settings, ``limit_tokens`` = the answers' training tokens (or
   ``--tokens``; ShareGPT holds far more): ``sharegpt/`` on ShareGPT, ``own/`` on the target's answers.
   A third arm fine-tunes the shipped head (ShareGPT, 1.7 M tokens) on the answers with the same budget.
3. Each head, and the shipped one, is scored on both held-out sets (top-1 agreement with the target at depths
   1..5), and the figures go to ``DIR/compare.json``. Acceptance in generation is measured afterwards with
   ``specdecode bench --head``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import specdecode as sd
from specdecode.heads.answer_rows import answer_markers
from specdecode.heads.model import TargetParts, lm_head_rows
from specdecode.heads.saved import load_head, shipped_head
from specdecode.heads.train import FeatureCache, TrainSettings, held_out_accuracy, read_samples, train_head


def sorted_answers(answers: Path, out: Path) -> Path:
    """The answers as chats in prompt order (make-data writes them as they finish)."""
    lines = answers.read_text().split("\n")  # not splitlines(): an answer may hold U+2028
    rows = [json.loads(line) for line in lines if line.strip()]
    rows.sort(key=lambda row: row["index"])
    path = out / "own.jsonl"
    path.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    return path


def scores(target: sd.LoadedModel, head_dir: Path, held_out: dict[str, list[list[int]]], cache_root: Path) -> dict:
    """Held-out top-1 by depth of the head in ``head_dir`` on each named held-out set: over every row, and over
    the answer rows alone (``NAME answers``: the rows drafting meets)."""
    head, draft_vocab, _ = load_head(head_dir, target)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    rows = lm_head_rows(target.model)[: target.vocab_size]
    result = {}
    for name, sequences in held_out.items():
        cache = FeatureCache(cache_root / name, target, torch.bfloat16)
        markers = answer_markers(target.tokenizer)
        figures = held_out_accuracy(head, parts, rows, cache, sequences, [draft_vocab.numel()], markers)
        cache.flush()
        result[name] = figures[draft_vocab.numel()]["top1_by_depth"]
        result[f"{name} answers"] = figures[draft_vocab.numel()]["answers_top1_by_depth"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = sd.load_model("smollm2", dtype="float32", quantization=None)
    own = sorted_answers(args.answers, args.out)
    sources = {"sharegpt": "sharegpt", "own": str(own)}

    def settings(data: str, limit_tokens: int | None, init_from: str | None = None) -> TrainSettings:
        return TrainSettings(
            data=data,
            held_out=args.held_out,
            epochs=args.epochs,
            draft_vocab=0 if init_from else args.draft_vocab,
            limit_tokens=limit_tokens,
            init_from=init_from,
        )

    held_out = {}
    for name, data in sources.items():
        held, train, _ = read_samples(target, settings(data, None if name == "own" else 1))
        held_out[name] = held
        if name == "own":  # ShareGPT has far more: the target's answers set the budget
            own_tokens = sum(len(s) for s in train)
    tokens = args.tokens or own_tokens
    report = {"limit_tokens": tokens, "own_training_tokens": own_tokens, "threads": torch.get_num_threads()}
    report["shipped"] = {"held_out_top1": scores(target, shipped_head(target), held_out, args.out / "eval-features")}
    print("shipped", json.dumps(report["shipped"]), flush=True)
    arms = {name: (data, None) for name, data in sources.items()}
    arms["shipped+own"] = (str(own), "shipped")  # the shipped head fine-tuned on the answers
    for name, (data, init_from) in arms.items():
        folder = args.out / name
        started = time.perf_counter()
        run = settings(data, tokens, init_from)
        result = train_head(target, run, folder, resume=(folder / "checkpoint.pt").is_file())
        report[name] = {
            "train_sequences": result.samples,
            "tokens_seen": result.tokens,
            "seconds": round(time.perf_counter() - started, 1),
            "held_out_top1": scores(target, folder, held_out, args.out / "eval-features"),
        }
        print(name, json.dumps(report[name]), flush=True)
    (args.out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
