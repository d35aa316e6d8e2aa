"""Exact sampling's time a token with the verification and draws in torch ops (before) and in the kernels' one
call (now: ``exact_chain``, ``inverse_cdf_rows``), for EAGLE at γ1 and for plain sampled decoding, alternated per
question in a rotating order after a warm-up pass, medians. The same seed gives the same tokens either way
(the same uniforms in the same order; checked on every question). The questions: ``specdecode bench``'s
``--categories --limit`` choice, first turns.

    .venv/bin/python scripts/time_exact_sampling.py ../shared/data/spec_bench/question.jsonl \\
        [--categories mt_bench] [--limit 10] [--temperature 0.8] [--repeats 2] [--tokens 128]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

import specdecode as sd
import specdecode.choices
import specdecode.verify
from specdecode.bench.workloads import build_prompt, load_items, select_items
from specdecode.proposers.eagle import EagleProposer


@contextlib.contextmanager
def torch_ops():
    """The torch path of ``speculative_sample`` and ``inverse_cdf`` (what ran before the kernels' call)."""
    with (
        mock.patch.object(specdecode.verify, "_chain_kernels", lambda *rows: None),
        mock.patch.object(specdecode.choices, "_sampling_kernels", lambda probs: None),
    ):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--categories", default="mt_bench", help="Spec-Bench subtasks or categories, comma-separated")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = sd.load_model("smollm2")
    proposer = EagleProposer(target)
    decoder = sd.SpeculativeDecoder(target, proposer, gamma=1, mode="exact")
    runner = target.new_runner()
    items = select_items(load_items(args.prompts), args.categories.split(","), args.limit)
    prompts = [build_prompt(target, item.turns[:1], []) for item in items]  # first turns
    paths = {"before": torch_ops, "now": contextlib.nullcontext}
    times: dict[tuple[str, str], list[float]] = {(m, p): [] for m in ("eagle", "plain") for p in paths}
    passes = []
    for repeat in range(args.repeats + 1):  # the first pass warms up
        for index, prompt in enumerate(prompts):
            order = list(paths) if (index + repeat) % 2 == 0 else list(reversed(paths))
            tokens = {}
            for path in order:
                params = sd.SamplingParams(temperature=args.temperature, max_new_tokens=args.tokens, seed=index)
                with paths[path]():
                    started = time.perf_counter()
                    out = decoder.generate(prompt, params)
                    eagle = (time.perf_counter() - started) / len(out.token_ids)
                    started = time.perf_counter()
                    plain = sd.autoregressive_generate(target, prompt, params, runner=runner)
                    plain_time = (time.perf_counter() - started) / len(plain.token_ids)
                tokens[path] = (out.token_ids, plain.token_ids)
                if repeat:
                    times["eagle", path].append(1e3 * eagle)
                    times["plain", path].append(1e3 * plain_time)
                    if path == "now":
                        passes.append(len(out.token_ids) / out.stats.rounds)
            assert tokens["before"] == tokens["now"], f"question {index}: the tokens differ"
    median = {key: statistics.median(value) for key, value in times.items()}
    print(f"exact sampling, T {args.temperature}, {len(prompts)} questions x {args.repeats}, {args.tokens} tokens, "
          f"EAGLE γ1 {statistics.mean(passes):.2f} tokens a pass; ms a token (median):")  # fmt: skip
    for method in ("eagle", "plain"):
        before, now = median[method, "before"], median[method, "now"]
        print(f"  {method:6s} before {before:.3f}  now {now:.3f}  ({before / now:.3f}x)")
    for path in paths:
        print(f"  EAGLE x plain, {path}: {median['plain', path] / median['eagle', path]:.3f}x")


if __name__ == "__main__":
    main()
