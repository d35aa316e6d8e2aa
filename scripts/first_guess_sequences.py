"""Record, per prompt, whether the EAGLE head's first guess matched the target's greedy token at every position
of the greedy answer (plain steps; the head is asked for one guess before each): the accept/reject sequences
``scripts/replay_auto_gamma.py`` replays controllers on.

    .venv/bin/python scripts/first_guess_sequences.py OUT.json PROMPTS.jsonl [PROMPTS.jsonl ...] [--head DIR]

First turns only, 128 new tokens, 2 threads. Keys are ``category:question_id``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import specdecode as sd
from specdecode.bench.workloads import build_prompt
from specdecode.factory import build_proposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("prompts", type=Path, nargs="+")
    parser.add_argument("--head", default=None, help="an EAGLE head folder (default: the shipped one)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = sd.load_model("smollm2")
    proposer = build_proposer("eagle", target, None, head=args.head, tree_nodes=0)
    params = sd.SamplingParams(max_new_tokens=args.tokens)
    sequences: dict[str, list[int]] = {}
    for path in args.prompts:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            decoder = sd.SpeculativeDecoder(target, proposer, gamma=1)
            request = decoder._start(build_prompt(target, item["turns"][:1], []), params, None, None)
            matched = []
            while not request.done:
                guess = int(decoder.draft(request, proposer, 1).draft.tokens[0])
                step = decoder.draft(request, None, 0)
                started = time.perf_counter()
                decoder.settle(request, step, decoder._runner.forward(step.tokens), decoder._runner, started)
                matched.append(int(guess == request.context[-1]))
            decoder.end_request(request, proposer)
            sequences[f"{item.get('category', 'prompt')}:{item.get('question_id')}"] = matched
            print(item.get("question_id"), len(matched), f"{sum(matched) / max(1, len(matched)):.3f}", flush=True)
    args.out.write_text(json.dumps(sequences))


if __name__ == "__main__":
    main()
