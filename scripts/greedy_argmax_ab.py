"""Greedy decoding's argmax through the CPU kernels (``argmax_rows``) against torch.argmax, in one process:
plain decoding and prompt lookup (γ auto) on Spec-Bench questions, the two argmaxes alternated per question,
the same tokens checked, ms per token (prefill left out) as medians and per-question ratios.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/greedy_argmax_ab.py ../shared/data/spec_bench/question.jsonl \\
        [--every 12] [--limit 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

import specdecode as sd
from specdecode import keyed_noise, sampling, verify
from specdecode.proposers.prompt_lookup import PromptLookupProposer


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def use(argmax) -> None:
    """Route greedy verification and plain greedy steps through ``argmax``."""
    verify.greedy_tokens = argmax
    keyed_noise.greedy_tokens = argmax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--every", type=int, default=12, help="take every N-th question's first turn")
    parser.add_argument("--limit", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = sd.load_model("smollm2")
    questions = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [q["turns"][0] for q in questions[:: args.every]][: args.limit]
    arms = {"torch": torch_argmax, "kernel": sampling.greedy_tokens}
    params = sd.SamplingParams(max_new_tokens=128)
    seconds: dict[tuple[str, str], list[float]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        ids = target.chat_prompt(prompt)
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        for method in ("plain", "lookup"):
            tokens = {}
            for arm in order:
                use(arms[arm])
                if method == "plain":
                    out = sd.autoregressive_generate(target, ids, params)
                else:
                    out = sd.SpeculativeDecoder(target, PromptLookupProposer(), gamma="auto").generate(ids, params)
                tokens[arm] = out.token_ids
                stats = out.stats
                seconds[method, arm].append((stats.total_seconds - stats.prefill_seconds) / len(out.token_ids))
            if tokens["torch"] != tokens["kernel"]:
                raise SystemExit(f"question {i}: the two argmaxes chose different tokens")
    use(sampling.greedy_tokens)
    for method in ("plain", "lookup"):
        before, after = seconds[method, "torch"], seconds[method, "kernel"]
        ratio = statistics.median([b / a for a, b in zip(before, after, strict=True)])
        print(
            f"{method}: torch.argmax {statistics.median(before) * 1e3:.3f} ms a token, kernel "
            f"{statistics.median(after) * 1e3:.3f}; kernel ÷ torch per question (median) {ratio:.4f}, n = {len(before)}"
        )


if __name__ == "__main__":
    main()
