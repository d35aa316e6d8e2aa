"""Quick EAGLE check: the first 10 Spec-Bench mt_bench questions, greedy, 96 new tokens, methods interleaved."""

import json
import time
from pathlib import Path

import torch

import specdecode as sd

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def main() -> None:
    torch.set_num_threads(2)
    target = sd.load_model("smollm2")
    lines = Path("../shared/data/spec_bench/question.jsonl").read_text().splitlines()
    questions = [q for q in map(json.loads, lines) if q["category"] in MT_BENCH][:10]
    params = sd.SamplingParams(max_new_tokens=96)
    makers = {
        "plain": None,
        "lookup-g4": lambda: sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=4),
        "eagle-chain-g4": lambda: sd.SpeculativeDecoder(target, sd.EagleProposer(target, tree_nodes=None), gamma=4),
        "eagle-t4-g4": lambda: sd.SpeculativeDecoder(target, sd.EagleProposer(target, tree_nodes=4), gamma=4),
        "eagle-t8-g4": lambda: sd.SpeculativeDecoder(target, sd.EagleProposer(target, tree_nodes=8), gamma=4),
    }
    decoders = {name: make() if make else None for name, make in makers.items()}

    def run(name: str, prompt: list[int]) -> sd.GenerationOutput:
        decoder = decoders[name]
        return decoder.generate(prompt, params) if decoder else sd.autoregressive_generate(target, prompt, params)

    for name in makers:  # warm-up
        run(name, target.chat_prompt(questions[0]["turns"][0]))
    totals = {name: {"seconds": 0.0, "tokens": 0, "rounds": 0, "differ": 0} for name in makers}
    for i, question in enumerate(questions):
        prompt = target.chat_prompt(question["turns"][0])
        names = list(makers)[i % len(makers) :] + list(makers)[: i % len(makers)]
        outs = {}
        for name in names:
            t0 = time.perf_counter()
            out = run(name, prompt)
            outs[name] = (time.perf_counter() - t0, out)
        reference = outs["plain"][1].token_ids
        for name, (seconds, out) in outs.items():
            total = totals[name]
            total["seconds"] += seconds
            total["tokens"] += len(out.token_ids)
            total["rounds"] += out.stats.rounds
            total["differ"] += out.token_ids != reference
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        print(
            f"{name:16s} tok/s {rate:6.1f}  vs plain {rate / plain_rate:.2f}x  "
            f"tokens/pass {t['tokens'] / t['rounds']:.2f}  differ {t['differ']}/{len(questions)}"
        )


if __name__ == "__main__":
    main()
