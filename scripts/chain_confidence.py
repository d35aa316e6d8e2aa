"""Does the EAGLE head's confidence predict acceptance? At every position of the target's greedy answer (plain
steps), the head drafts a greedy chain of --depth guesses; each guess is recorded with the head's probability
for it (softmax of its logits over the drafting vocabulary) and whether it matches the target's answer there.

    .venv/bin/python scripts/chain_confidence.py OUT.json PROMPTS.jsonl [PROMPTS.jsonl ...] [--head DIR]

OUT holds, per prompt, ``{"answer": [...], "guesses": [[token, prob] * depth] per position}``; with the answer
known, every greedy chain's acceptance follows (greedy rounds accept the guesses' longest matching run), so a
drafting rule that reads only the head's probabilities can be replayed on it offline. First turns only, 128 new
tokens, 2 threads, default drafting settings (kernels when they built).
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None, help="prompts per file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = sd.load_model("smollm2")
    proposer = build_proposer("eagle", target, None, head=args.head, tree_nodes=0)
    probs_seen: list[float] = []
    top = proposer._top

    def recording_top(logits: torch.Tensor, n: int) -> torch.Tensor:
        picked = top(logits, n)
        probs_seen.append(float(torch.softmax(logits.float(), -1)[picked[0]]))
        return picked

    proposer._top = recording_top  # greedy chains pick through _top: record the picked guess's probability
    params = sd.SamplingParams(max_new_tokens=args.tokens)
    records: dict[str, dict] = {}
    for path in args.prompts:
        items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][: args.limit]
        for item in items:
            decoder = sd.SpeculativeDecoder(target, proposer, gamma=args.depth)
            request = decoder._start(build_prompt(target, item["turns"][:1], []), params, None, None)
            start = len(request.context)
            guesses = []
            while not request.done:
                probs_seen.clear()
                chain = decoder.draft(request, proposer, args.depth).draft.tokens.tolist()
                guesses.append([[t, round(p, 5)] for t, p in zip(chain, probs_seen, strict=True)])
                step = decoder.draft(request, None, 0)
                decoder.settle(request, step, decoder._runner.forward(step.tokens), decoder._runner, 0.0)
            decoder.end_request(request, proposer)
            answer = request.context[start:]
            key = f"{item.get('category', 'prompt')}:{item.get('question_id')}"
            records[key] = {"answer": answer, "guesses": guesses}
            first = sum(g[0][0] == a for g, a in zip(guesses, answer, strict=False)) / max(1, len(answer))
            print(key, len(answer), f"first guess {first:.3f}", flush=True)
    args.out.write_text(json.dumps(records))


if __name__ == "__main__":
    main()
