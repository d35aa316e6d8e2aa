"""Measure a saved head's sampling temperature factors on held-out chats and (``--write``) store them in its
config.json (``sampling_calibration``; train-head does this itself, on its held-out chats, for the heads it trains).

    .venv/bin/python recipes/calibrate_head.py --at 0.8=DIR08/answers.jsonl --at 1.0=DIR10/answers.jsonl \
        --head DIR|shipped [--write]

Each ``--at T=FILE`` calibrates request temperature T on the chats of a make-data answers file (best: the held-out
prompts answered at temperature T, the contexts a request at T meets): its first ``--held-out`` chats in prompt
order, as train-head reads them. Prints the mean overlap sum_x min(p, q) per temperature, factor and depth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import specdecode as sd
from specdecode.heads.model import TargetParts, lm_head_rows
from specdecode.heads.saved import load_head, shipped_head
from specdecode.training.calibrate import FACTORS, calibration_record, temperature_overlaps
from specdecode.training.features import FeatureCache, batch_tensors
from specdecode.training.samples import read_samples
from specdecode.training.train import TrainSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", action="append", required=True, help="T=FILE: temperature T on FILE's chats")
    parser.add_argument("--head", required=True, help="a head folder, or shipped")
    parser.add_argument("--features", type=Path, default=Path("/tmp/calibrate-features"))
    parser.add_argument("--held-out", type=int, default=31, help="of make-data --limit 32 (one is left to train on)")
    parser.add_argument("--factors", default=",".join(map(str, FACTORS)))
    parser.add_argument("--depths", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="store the chosen factors in the head's config.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = sd.load_model("smollm2", dtype="float32", quantization=None)
    folder = shipped_head(target) if args.head == "shipped" else Path(args.head)
    head, draft_vocab, config = load_head(folder, target)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    rows = lm_head_rows(target.model)[: target.vocab_size]
    factors = tuple(float(f) for f in args.factors.split(","))
    overlaps = {}
    for spec in args.at:
        temperature, answers = spec.split("=", 1)
        held, _, _ = read_samples(target, TrainSettings(data=answers, held_out=args.held_out, limit=1))
        cache = FeatureCache(args.features / f"T{temperature}", target, torch.bfloat16)
        sequences = (batch_tensors(cache, "h", held, [i]) for i in range(len(held)))
        overlaps |= temperature_overlaps(head, parts, rows, sequences, (float(temperature),), factors, args.depths)
        cache.flush()
    record = calibration_record(overlaps)
    for t, by_f in overlaps.items():
        print(f"T {t}: " + "  ".join(f"x{f} {v}" for f, v in by_f.items()), flush=True)
    print("chosen:", json.dumps({k: record[k] for k in ("temperatures", "factors")}))
    record["contexts"] = {t.split("=", 1)[0]: t.split("=", 1)[1] for t in args.at}  # where each T was measured
    if args.write:
        config["sampling_calibration"] = record
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"written to {folder / 'config.json'}")


if __name__ == "__main__":
    main()
