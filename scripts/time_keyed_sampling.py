"""Plain sampled decoding's time a token with the keyed noise drawn as before (numpy's Philox for the whole
vocabulary, two float64 logarithms a token: ``argmax(l + gumbel_noise)``) and now (``keyed_argmax``: the C
kernel's Philox, logarithms only for the tokens that can win), alternated over a prompt file's questions, the
same tokens (the function is the same; checked), medians.

    .venv/bin/python scripts/time_keyed_sampling.py ../shared/data/spec_bench/question.jsonl \\
        [--categories writing] [--limit 10] [--temperature 0.8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import specdecode as sd
from specdecode import keyed_noise
from specdecode.bench.workloads import build_prompt


def full_vocabulary_argmax(warped: torch.Tensor, seed: int, positions: list[int]) -> torch.Tensor:
    """The definition, as computed before: the whole vocabulary's noise, then the argmax."""
    noise = torch.stack([keyed_noise.gumbel_noise(seed, t, warped.shape[-1]) for t in positions])
    return (warped + noise).argmax(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--categories", default="writing")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = sd.load_model("smollm2")
    runner = target.new_runner()
    wanted = set(args.categories.split(","))
    items = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [build_prompt(target, item["turns"][:1], []) for item in items if item.get("category") in wanted]
    prompts = prompts[: args.limit]
    kernel_argmax = keyed_noise.keyed_argmax
    times: dict[str, list[float]] = {"before": [], "now": []}
    for repeat in range(args.repeats + 1):  # the first pass warms up
        for index, prompt in enumerate(prompts):
            outputs = {}
            for name, argmax in (("before", full_vocabulary_argmax), ("now", kernel_argmax)):
                keyed_noise.keyed_argmax = argmax
                params = sd.SamplingParams(temperature=args.temperature, max_new_tokens=128, seed=index)
                out = sd.autoregressive_generate(target, prompt, params, runner=runner)
                outputs[name] = out.token_ids
                if repeat:
                    times[name].append(1e3 * out.stats.verify_seconds / out.stats.rounds)
            assert outputs["before"] == outputs["now"], f"question {index}: the tokens differ"
    keyed_noise.keyed_argmax = kernel_argmax
    before, now = statistics.median(times["before"]), statistics.median(times["now"])
    print(f"plain sampled decoding, T {args.temperature}, {len(prompts)} questions x {args.repeats}: "
          f"{before:.3f} ms a token before, {now:.3f} now (median), {before / now:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
