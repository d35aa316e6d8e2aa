"""Held-out top-1 agreement with the target, depths 1..5, of several heads on the same held-out chats: the first
32 of a make-data answers file (sorted by prompt index, as train-head reads them) and the first 32 ShareGPT
conversations (the stage-1 held-out set), over every row and over the answer rows alone (``SET answers``: the rows
whose guess is an assistant's token, ``training/answer_rows.py``). Features are computed once and shared by the heads.

    .venv/bin/python recipes/score_heads.py --answers DIR/answers.jsonl --out DIR --head NAME=DIR [--head ...]

``--head NAME=shipped`` scores the head shipped for smollm2; the figures go to ``DIR/scores.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import specdecode as sd
from specdecode.heads.model import TargetParts, lm_head_rows
from specdecode.heads.saved import load_head, shipped_head
from specdecode.training.answer_rows import answer_markers
from specdecode.training.features import FeatureCache
from specdecode.training.samples import read_samples
from specdecode.training.train import TrainSettings, held_out_accuracy


def scores(target: sd.LoadedModel, head_dir: Path, held_out: dict[str, list[list[int]]], cache_root: Path) -> dict:
    """Held-out top-1 by depth of the head in ``head_dir`` on each named held-out set: over every row, and over
    the answer rows alone (``NAME answers``: the rows drafting meets)."""
    head, draft_vocab, _ = load_head(head_dir, target)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    rows = lm_head_rows(target.model)[: target.vocab_size]
    result = {}
    for name, sequences in held_out.items():
        cache = FeatureCache(cache_root / name, target, torch.bfloat16)
        markers = answer_markers(target)
        figures = held_out_accuracy(head, parts, rows, cache, sequences, [draft_vocab.numel()], markers)
        cache.flush()
        result[name] = figures[draft_vocab.numel()]["top1_by_depth"]
        result[f"{name} answers"] = figures[draft_vocab.numel()]["answers_top1_by_depth"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--head", action="append", required=True, help="NAME=DIR (repeatable; DIR may be shipped)")
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    target = sd.load_model("smollm2", dtype="float32", quantization=None)
    held_out = {}
    for name, data in (("own answers", str(args.answers)), ("sharegpt text", "sharegpt")):
        held, _, _ = read_samples(target, TrainSettings(data=data, held_out=args.held_out, limit=1))
        held_out[name] = held
    report = {name: {"chats": len(seqs), "tokens": sum(map(len, seqs))} for name, seqs in held_out.items()}
    for spec in args.head:
        name, folder = spec.split("=", 1)
        path = shipped_head(target) if folder == "shipped" else Path(folder)
        report[name] = scores(target, path, held_out, args.out / "features")
        print(name, json.dumps(report[name]), flush=True)
    (args.out / "scores.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
