"""Time to first token with the prefix cache on and off: a multi-turn chat in the library, and many server
requests that share one system prompt.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/prefix_cache.py [--target smollm2|FILE.gguf] [--turns 6]
        [--question-tokens 60] [--system-tokens 1000] [--requests 32] [--max-batch 16] [--max-new-tokens 32]
        [--draft MODEL]

Chat: each turn's prompt is the whole history (earlier prompts and answers) plus a new question of random ids
(seed 0); one ``SpeculativeDecoder`` (prompt lookup, greedy), its cache reused across turns ("on") or forgotten
before each turn ("off"). Server: ``--requests`` prompts, a ``--system-tokens`` shared prefix plus a few ids of
their own, submitted at once to the scheduler (no HTTP) with a prefix cache of ``--cache-gb`` or none. Both
check that the greedy texts are identical on and off. Prints one JSON object: per turn / request the time to
first token, totals, and the bytes the cache holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

import specdecode as sd
from specdecode.engine.request import Request
from specdecode.serving.batching.policy import SpeculationPolicy
from specdecode.serving.batching.prefix_cache import GIB, PrefixCache
from specdecode.serving.batching.scheduler import Job, Scheduler, Speculation


def _ids(target: sd.LoadedModel, n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, target.vocab_size, (n,), generator=generator).tolist()


def chat(
    target: sd.LoadedModel, turns: int, question_tokens: int, max_new_tokens: int, reuse: bool,
    draft: sd.LoadedModel | str | None = None,
) -> dict:  # fmt: skip
    """Per turn: seconds to the first streamed text, total seconds, prompt tokens, tokens reused; the answers. With
    ``draft``, a draft model proposes (it keeps its own longest common prefix either way: the "on" turns then show
    its catch-up over the new tokens inside the time to first token)."""
    generator = torch.Generator().manual_seed(0)
    params = sd.SamplingParams(max_new_tokens=max_new_tokens)
    if draft is None:
        proposer = sd.PromptLookupProposer()
    else:  # "eagle": the target's EAGLE head, which recomputes its one-layer cache from the reused features
        proposer = sd.EagleProposer(target) if draft == "eagle" else sd.DraftModelProposer(draft)
    decoder = sd.SpeculativeDecoder(target, proposer, gamma="auto")
    history: list[int] = []
    rows, answers = [], []
    for _ in range(turns):
        prompt = history + _ids(target, question_tokens, generator)
        if not reuse:
            decoder.forget_cache()
        first: list[float] = []
        start = time.perf_counter()
        out = decoder.generate(
            prompt, params, on_text=lambda _t, first=first: first or first.append(time.perf_counter())
        )
        end = time.perf_counter()
        ttft = (first[0] if first else end) - start
        rows.append({"prompt": len(prompt), "reused": out.cached_tokens, "ttft": round(ttft, 4),
                     "total": round(end - start, 4)})  # fmt: skip
        answers.append(out.token_ids)
        history = prompt + out.token_ids
    return {"turns": rows, "answers": answers}


def shared_prompt(
    target: sd.LoadedModel, requests: int, system_tokens: int, max_new_tokens: int, max_batch: int, cache_gb: float
) -> dict:
    """``requests`` prompts sharing a system prompt, all submitted at once: time to first token per request, the
    total, the cache's bytes; the answers."""
    generator = torch.Generator().manual_seed(1)
    system = _ids(target, system_tokens, generator)
    prompts = [system + _ids(target, 8, generator) for _ in range(requests)]
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma="auto")
    cache = PrefixCache(int(cache_gb * GIB)) if cache_gb > 0 else None
    scheduler = Scheduler(
        decoder, {"lookup": sd.PromptLookupProposer}, SpeculationPolicy("auto"), max_batch, prefix_cache=cache
    )
    scheduler.start()
    params = sd.SamplingParams(max_new_tokens=max_new_tokens)
    firsts: list[float | None] = [None] * requests
    outputs: list[sd.GenerationOutput | None] = [None] * requests
    done = threading.Semaphore(0)

    def deliver(i: int):
        def on_event(event) -> None:
            if event.kind == "text" and firsts[i] is None:
                firsts[i] = time.perf_counter()
            if event.kind in ("done", "error"):
                outputs[i] = event.output
                done.release()

        return on_event

    start = time.perf_counter()
    try:
        for i, prompt in enumerate(prompts):
            scheduler.submit(Job(Request(target, prompt, params, None), Speculation("lookup", "auto"), deliver(i)))
        for _ in prompts:
            done.acquire()
    finally:
        total = time.perf_counter() - start
        scheduler.stop()
    if any(out is None for out in outputs):
        raise RuntimeError("a request failed in the scheduler")
    ttfts = [(t if t is not None else start) - start for t in firsts]
    return {
        "ttft_median": round(statistics.median(ttfts), 4),
        "ttft_max": round(max(ttfts), 4),
        "total": round(total, 4),
        "reused": sum(out.cached_tokens for out in outputs),
        "cache_bytes": 0 if cache is None else cache.bytes,
        "answers": [out.token_ids for out in outputs],
    }


def run(target: sd.LoadedModel, args: argparse.Namespace, draft: sd.LoadedModel | str | None = None) -> dict:
    """Both workloads, cache off then on, and whether their greedy answers are identical."""
    result: dict[str, object] = {"target": args.target, "draft": args.draft}
    for name, work in (
        ("chat", lambda reuse: chat(target, args.turns, args.question_tokens, args.max_new_tokens, reuse, draft)),
        ("shared_prompt", lambda reuse: shared_prompt(target, args.requests, args.system_tokens, args.max_new_tokens,
                                                      args.max_batch, args.cache_gb if reuse else 0)),
    ):  # fmt: skip
        off, on = work(False), work(True)
        identical = off.pop("answers") == on.pop("answers")
        result[name] = {"off": off, "on": on, "identical": identical}
        print(json.dumps({name: result[name]}), flush=True)
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--question-tokens", type=int, default=60)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cache-gb", type=float, default=1.0)
    parser.add_argument("--draft", help="the chat drafts with this model (a name or file; eagle: the target's EAGLE "
                        "head) instead of prompt lookup")  # fmt: skip
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    draft = args.draft if args.draft in (None, "eagle") else sd.load_model(args.draft)
    result = run(sd.load_model(args.target), args, draft)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
