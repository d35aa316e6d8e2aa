"""What a small draft model buys a big target: the target's one-token step and v(k) over a warm cache, the draft's
step at the same context as it drafts (through its drafting head where ``vocabulary="auto"`` cuts one: the full
head's step is shown beside it), c = draft step / target step, and the planner's predicted speedup and best gamma at
α = 0.6 / 0.7 / 0.8 — both models on the compiled kernels in one process (one thread pool), measurements alternated.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/draft_cost.py TARGET.gguf [--draft smollm2] [--context 500] [--reps 9]

The target must share the draft's tokenizer (``specdecode bench --synthetic 1.7b,8b`` writes SmolLM2-1.7B / Llama-8B
shapes with the bundled SmolLM2 tokenizer and random weights into ``<cache>/synthetic/``: acceptance cannot be
measured on those, so α is a parameter here).
Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import specdecode as sd
from specdecode.planner import VerifyCost, best_gamma
from specdecode.proposers.draft_model import drafting_head

ALPHAS = (0.6, 0.7, 0.8)
KS = range(1, 10)  # verify passes of gamma + 1 tokens, gamma up to 8


def _timed(runner, ids: torch.Tensor, context: int) -> float:
    start = time.perf_counter()
    runner.forward(ids)
    elapsed = time.perf_counter() - start
    runner.rollback_to(context)
    return elapsed


def _timed_head(runner, head, ids: torch.Tensor, context: int) -> float:
    """One draft step as ``DraftModelProposer`` takes it with a drafting head: the rows, then the cut head."""
    start = time.perf_counter()
    runner.prefill(ids)
    head.logits(runner.hidden[-1:])
    elapsed = time.perf_counter() - start
    runner.rollback_to(context)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("--draft", default="smollm2")
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, draft = sd.load_model(args.target), sd.load_model(args.draft)
    if target.vocab_size != draft.vocab_size:  # costs only: a real pairing shares one vocabulary
        print(f"note: the draft's vocabulary ({draft.vocab_size}) is not the target's ({target.vocab_size}): these are "
              "the two models' costs, not a pairing speculation could run")  # fmt: skip
    vocab = min(target.vocab_size, draft.vocab_size)
    ids = torch.randint(0, vocab, (args.context + max(KS),), generator=torch.Generator().manual_seed(0))
    runners = {"target": target.new_runner(), "draft": draft.new_runner(), "cut": draft.new_runner()}
    head = drafting_head(draft, runners["cut"])
    if head is None:
        del runners["cut"]
    else:
        runners["cut"].capture_hidden = True
        head.use(ids[: args.context].tolist())
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for runner in runners.values():
            runner.prefill(ids[: args.context])
        for rep in range(args.reps + 2):  # two warm-up rounds, then alternate target k = 1..9 and the draft step
            for k in KS:
                cases = [("target", k)] + ([(name, 1) for name in runners if name != "target"] if k == 1 else [])
                for name, rows in cases:
                    chunk = ids[args.context : args.context + rows]
                    if name == "cut":
                        elapsed = _timed_head(runners[name], head, chunk, args.context)
                    else:
                        elapsed = _timed(runners[name], chunk, args.context)
                    if rep >= 2:
                        times.setdefault((name, rows), []).append(elapsed)
    step = {key: statistics.median(values) for key, values in times.items()}
    t1 = step[("target", 1)]
    v = {k: step[("target", k)] / t1 for k in KS}
    drafted = step[("cut", 1)] if head is not None else step[("draft", 1)]  # the step the proposer takes
    cost = drafted / t1
    curve = VerifyCost(tuple(v.items()))
    rows = []
    for alpha in ALPHAS:
        best = best_gamma(alpha, cost, curve, max_gamma=max(KS) - 1)
        rows.append({"alpha": alpha, "gamma": best.gamma, "speedup": best.speedup})
    print(f"target {args.target}: {target.describe()}")
    print(f"draft {args.draft}: {draft.describe()}")
    alphas = " | ".join(f"α={a}" for a in ALPHAS)
    cut = "none" if head is None else f"{head.keep:,} of {draft.vocab_size:,} ids"
    print(f"\n| target step (ms) | draft step, full head (ms) | drafting head ({cut}) (ms) | c | v(2) | v(3) | v(5) | "
          f"v(9) | {alphas} |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(ALPHAS))
    predicted = " | ".join(f"{r['speedup']:.2f}× at γ={r['gamma']}" for r in rows)
    shown = "–" if head is None else f"{1000 * drafted:.2f}"
    print(f"| {1000 * t1:.1f} | {1000 * step[('draft', 1)]:.2f} | {shown} | {cost:.3f} | {v[2]:.2f} | {v[3]:.2f} | "
          f"{v[5]:.2f} | {v[9]:.2f} | {predicted} |")  # fmt: skip
    print(json.dumps({"target_step_ms": 1000 * t1, "draft_step_ms": 1000 * step[("draft", 1)],
                      "drafting_head_step_ms": None if head is None else 1000 * drafted, "c": cost, "v": v,
                      "predicted": rows, "context": args.context}))  # fmt: skip


if __name__ == "__main__":
    main()
