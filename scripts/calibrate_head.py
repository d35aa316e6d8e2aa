"""Measure a saved head's sampling temperature factors on held-out chats and (``--write``) store them in its
config.json (``sampling_calibration``; train-head does this itself for the heads it trains).

    .venv/bin/python scripts/calibrate_head.py --answers DIR/answers.jsonl --head DIR|shipped [--write]

The held-out chats are the first 32 of a make-data answers file, as train-head holds them out (sorted by prompt
index). Prints the mean overlap sum_x min(p, q) per request temperature, factor and depth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import specdecode as sd
from specdecode.heads.calibrate import FACTORS, TEMPERATURES, calibration_record, temperature_overlaps
from specdecode.heads.model import TargetParts, lm_head_rows
from specdecode.heads.saved import load_head, shipped_head
from specdecode.heads.train import FeatureCache, TrainSettings, batch_tensors, read_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=Path, required=True)
    parser.add_argument("--head", required=True, help="a head folder, or shipped")
    parser.add_argument("--features", type=Path, default=Path("/tmp/calibrate-features"))
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--temperatures", default=",".join(map(str, TEMPERATURES)))
    parser.add_argument("--factors", default=",".join(map(str, FACTORS)))
    parser.add_argument("--depths", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="store the chosen factors in the head's config.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = sd.load_model("smollm2", dtype="float32", quantization=None)
    folder = shipped_head(target) if args.head == "shipped" else Path(args.head)
    head, draft_vocab, config = load_head(folder, target)
    held, _, _ = read_samples(target, TrainSettings(data=str(args.answers), held_out=args.held_out, limit=1))
    cache = FeatureCache(args.features, target, torch.bfloat16)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    rows = lm_head_rows(target.model)[: target.vocab_size]
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    factors = tuple(float(f) for f in args.factors.split(","))
    sequences = (batch_tensors(cache, "h", held, [i]) for i in range(len(held)))
    overlaps = temperature_overlaps(head, parts, rows, sequences, temperatures, factors, args.depths)
    cache.flush()
    record = calibration_record(overlaps)
    for t, by_f in overlaps.items():
        print(f"T {t}: " + "  ".join(f"x{f} {v}" for f, v in by_f.items()), flush=True)
    print("chosen:", json.dumps({k: record[k] for k in ("temperatures", "factors")}))
    if args.write:
        config["sampling_calibration"] = record
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"written to {folder / 'config.json'}")


if __name__ == "__main__":
    main()
