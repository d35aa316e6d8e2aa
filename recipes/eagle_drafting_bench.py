"""EAGLE drafting on torch ops against the compiled kernels (head weight formats, chain and tree shapes), in one
process.

For each prompt (a JSONL of Spec-Bench-style questions) the variants run in turn after one warm-up each:
plain decoding, then every (head, drafter, shape) triple, greedy. Prints one markdown table of medians/means
and writes the per-prompt records as JSON.

    .venv/bin/python recipes/eagle_drafting_bench.py docs/bench/eagle/unseen_chat.jsonl --out DIR \
        [--head NAME=DIR ...] [--variants "kernels/chain γ1,kernels/tree 3 nodes"]

``--head`` (repeatable) compares heads (default: the shipped one, named "shipped"); ``--variants`` keeps the
(drafter/shape) variants named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import specdecode as sd

# (drafter, shape): proposer arguments and gamma. "torch int8" is the head as it drafted before the kernels;
# "kernels" the default (8-bit layer and read-out); "float32" the head's own numerics (slow: for acceptance).
VARIANTS = {
    ("torch int8", "chain γ3"): ({"kernels": False, "tree_nodes": None}, 3),
    ("torch int8", "tree 3 nodes"): ({"kernels": False, "tree_nodes": 3}, 3),
    ("kernels", "chain γ1"): ({"tree_nodes": None}, 1),
    ("kernels", "chain γ2"): ({"tree_nodes": None}, 2),
    ("kernels", "chain γ3"): ({"tree_nodes": None}, 3),
    ("kernels", "chain γ4"): ({"tree_nodes": None}, 4),
    ("kernels", "tree 2 nodes"): ({"tree_nodes": 2}, 2),
    ("kernels", "tree 3 nodes"): ({"tree_nodes": 3}, 3),
    ("kernels", "tree 4 nodes"): ({"tree_nodes": 4}, 3),
    ("kernels", "tree 6 nodes, depth 4"): ({"tree_nodes": 6}, 4),
    ("kernels 4-bit read-out", "chain γ1"): ({"tree_nodes": None, "readout_bits": 4}, 1),
    ("kernels 4-bit read-out", "chain γ2"): ({"tree_nodes": None, "readout_bits": 4}, 2),
    ("kernels 4-bit read-out", "chain γ3"): ({"tree_nodes": None, "readout_bits": 4}, 3),
    ("torch int8", "chain γ1"): ({"kernels": False, "tree_nodes": None}, 1),
    ("float32", "chain γ1"): ({"kernels": False, "int8": False, "dtype": torch.float32, "tree_nodes": None}, 1),
    ("kernels 4-bit layer", "chain γ3"): ({"tree_nodes": None, "weight_bits": 4}, 3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--head", action="append", default=[], help="NAME=DIR (repeatable); default: shipped")
    parser.add_argument("--variants", default=None, help="comma-separated drafter/shape names (default: all)")
    args = parser.parse_args()
    heads = dict(h.split("=", 1) for h in args.head) or {"shipped": None}
    wanted = None if args.variants is None else set(args.variants.split(","))
    variants = {key: value for key, value in VARIANTS.items() if wanted is None or "/".join(key) in wanted}
    if wanted is not None and len(variants) != len(wanted):
        parser.error(f"unknown variants: {sorted(wanted - {'/'.join(k) for k in variants})}")
    torch.set_num_threads(args.threads)
    target = sd.load_model("smollm2")
    questions = [json.loads(line) for line in args.prompts.open() if line.strip()]
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=args.tokens)
    decoders = {
        (name, *key): sd.SpeculativeDecoder(target, sd.EagleProposer(target, head=folder, **kwargs), gamma=gamma)
        for name, folder in heads.items()
        for key, (kwargs, gamma) in variants.items()
    }
    records = []
    for question in questions:
        prompt = target.chat_prompt(question["turns"][0])
        sd.autoregressive_generate(target, prompt, params)  # warm-up
        started = time.perf_counter()
        plain = sd.autoregressive_generate(target, prompt, params)
        plain_seconds = time.perf_counter() - started
        record = {"id": question["question_id"], "plain_seconds": plain_seconds, "tokens": len(plain.token_ids)}
        for key, decoder in decoders.items():
            decoder.generate(prompt, params)  # warm-up
            out = decoder.generate(prompt, params)
            st = out.stats
            record["/".join(key)] = {
                "identical": out.token_ids == plain.token_ids,
                "seconds": st.total_seconds,
                "rounds": st.rounds,
                "generated": st.generated,
                "first_accepted": st.per_position[0] / st.rounds if st.per_position and st.rounds else 0.0,
                "draft_ms_per_round": 1e3 * st.draft_seconds / max(st.rounds, 1),
                "verify_ms_per_round": 1e3 * st.verify_seconds / max(st.rounds, 1),
            }
        records.append(record)
        print(f"prompt {question['question_id']} done", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "records.json").write_text(json.dumps(records, indent=1) + "\n")
    step_ms = statistics.median(1e3 * r["plain_seconds"] / r["tokens"] for r in records)
    print(f"\nplain step (median over prompts): {step_ms:.2f} ms\n")
    print(
        "| head | drafter | shape | first guess accepted | tokens / pass | draft ms / pass | draft ÷ plain step "
        "| verify ÷ plain step | × plain | outputs differing |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in decoders:
        runs = [r["/".join(key)] for r in records]
        rounds = sum(r["rounds"] for r in runs)
        first = sum(r["first_accepted"] * r["rounds"] for r in runs) / rounds
        per_pass = sum(r["generated"] for r in runs) / rounds
        draft = sum(r["draft_ms_per_round"] * r["rounds"] for r in runs) / rounds
        verify = sum(r["verify_ms_per_round"] * r["rounds"] for r in runs) / rounds
        speedup = sum(r["plain_seconds"] for r in records) / sum(r["seconds"] for r in runs)
        differing = sum(not r["identical"] for r in runs)
        print(
            f"| {' | '.join(key)} | {100 * first:.1f}% | {per_pass:.2f} | {draft:.2f} | {draft / step_ms:.3f} "
            f"| {verify / step_ms:.2f} | {speedup:.2f}× | {differing}/{len(runs)} |"
        )


if __name__ == "__main__":
    main()
