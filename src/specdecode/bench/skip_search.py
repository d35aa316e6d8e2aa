"""``tune-skip``: which of the target's layers a self-draft should skip, chosen by predicted then measured speed.

Under greedy decoding a draft's guess at depth d is accepted exactly when its argmax, given the accepted
prefix (the target's own tokens), equals the target's token. So one teacher-forced pass of a skipping view
over the target's greedy continuation tells, position by position, which guesses would be accepted, and
``chain_rounds`` replays the rounds a chain of ``gamma`` guesses would take over it — no i.i.d. assumption.
With the draft's step cost c (a per-layer cost model, timed) and this CPU's verify curve v(k), a round costs
``v(gamma + 1) + gamma * c`` plain steps, and the draft prefills each prompt through its kept layers, so the
predicted speedup of a skip set is ``(P + tokens) / (P + P_draft + sum over rounds of (v(gamma + 1) +
gamma * c))`` with P the target's timed prefills in steps; ``flat`` is the same with v(k) = 1 (a GPU, where
verifying k tokens costs one step).

The search is greedy (as Draft & Verify's layer-by-layer search): starting from no skipped layer, add the one
whose removal predicts the highest speedup, up to ``max_skip`` layers; then the best few sets of the path are
confirmed end to end by the bench (plain vs each, interleaved) and the measured best is chosen.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..models.loaded import LoadedModel
from ..planner import VerifyCost
from ..proposers.layer_skip import layer_count, skipping_model, truncated_model


@dataclass(frozen=True)
class SearchSettings:
    """How much the search reads and how far it goes."""

    new_tokens: int = 64  # the target's greedy continuation per prompt, replayed for every candidate
    max_skip: int | None = None  # most layers skipped (default: half the layers)
    max_gamma: int = 8
    confirm: int = 3  # sets of the path measured end to end

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise ValueError(f"--new-tokens must be >= 2, got {self.new_tokens}")
        if self.max_skip is not None and self.max_skip < 1:
            raise ValueError(f"--max-skip must be >= 1, got {self.max_skip}")
        if self.max_gamma < 1:
            raise ValueError(f"--max-gamma must be >= 1, got {self.max_gamma}")
        if self.confirm < 0:
            raise ValueError(f"--confirm must be >= 0, got {self.confirm}")


@dataclass(frozen=True)
class Continuation:
    """A prompt and the target's greedy continuation of it (``tokens`` = both), and the target's prefill time
    for the prompt (the draft prefills it too, through its kept layers)."""

    tokens: list[int]
    prompt_length: int
    prefill_ms: float = 0.0


@dataclass(frozen=True)
class StepCost:
    """A draft step's milliseconds as ``fixed + kept * per_layer`` (embedding, final norm and LM head are
    ``fixed``), fitted to timed forwards; ``ratio(kept)`` = c, the draft step over the target's."""

    fixed_ms: float
    per_layer_ms: float
    layers: int

    def milliseconds(self, kept: int) -> float:
        return self.fixed_ms + kept * self.per_layer_ms

    def ratio(self, kept: int) -> float:
        return self.milliseconds(kept) / self.milliseconds(self.layers)


@dataclass(frozen=True)
class Candidate:
    """One skip set as the search saw it: acceptance, cost, its best gamma and the predicted speedups."""

    skip: tuple[int, ...]
    acceptance: float  # share of the continuations' positions where the draft's argmax is the target's token
    tokens_per_round: float  # at ``gamma``, replayed
    cost: float  # c, predicted by the step-cost model
    gamma: int
    predicted: float  # on this machine's verify curve
    flat: float  # with v(k) = 1

    def to_json(self) -> dict:
        data = asdict(self)
        data["skip"] = list(self.skip)
        return data


def chain_rounds(accepted: Sequence[bool], gamma: int) -> int:
    """Rounds a chain of ``gamma`` guesses takes to emit ``len(accepted)`` tokens, where ``accepted[j]`` says
    whether the guess for token j (given tokens < j) equals it: each round emits its accepted run r <= gamma
    and one token of the target's (the correction, or the bonus), so it covers r + 1 tokens."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    n, position, rounds = len(accepted), 0, 0
    while position < n:
        run = 0
        while run < gamma and position + run < n and accepted[position + run]:
            run += 1
        position += run + 1
        rounds += 1
    return rounds


def predicted_speedup(
    rounds: int,
    tokens: int,
    gamma: int,
    cost: float,
    verify: Callable[[int], float],
    prefill: float = 0.0,
    draft_prefill: float = 0.0,
) -> float:
    """Plain takes ``prefill + tokens`` steps; speculation ``prefill + draft_prefill`` and ``rounds`` rounds of
    ``v(gamma + 1) + gamma * c`` steps each (prefills in steps: the prompt's, the target's and the draft's)."""
    return (prefill + tokens) / (prefill + draft_prefill + rounds * (verify(gamma + 1) + gamma * cost))


def continuations(
    target: LoadedModel, prompts: Sequence[list[int]], new_tokens: int, on_step: Callable[[], None] | None = None
) -> list[Continuation]:
    """The target's greedy continuation of each prompt (stopping early at an end-of-sequence token), and the
    median of three timed prefills of the prompt."""
    from ..engine.decoder import autoregressive_generate
    from ..sampling.params import SamplingParams

    out = []
    runner = target.new_runner()
    for prompt in prompts:
        generated = autoregressive_generate(target, prompt, SamplingParams(max_new_tokens=new_tokens), runner=runner)
        times = []
        for _ in range(3):
            runner.reset()
            t0 = time.perf_counter()
            runner.prefill(torch.tensor(prompt, dtype=torch.int64))
            times.append((time.perf_counter() - t0) * 1e3)
        if len(generated.token_ids) >= 2:
            out.append(Continuation(list(prompt) + list(generated.token_ids), len(prompt), statistics.median(times)))
        if on_step is not None:
            on_step()
    if not out:
        raise ValueError("the target wrote fewer than 2 tokens for every prompt: nothing to tune on")
    return out


@torch.inference_mode()
def agreement(view: LoadedModel, runs: Sequence[Continuation]) -> list[list[bool]]:
    """Per continuation, whether ``view``'s argmax at each generated position is the target's token (one
    teacher-forced pass of the view's own runner: the logits its drafting would compute, bitwise)."""
    runner = view.new_runner()
    out = []
    for run in runs:
        runner.reset()
        tokens = torch.tensor(run.tokens, dtype=torch.int64)
        p = run.prompt_length
        if p > 1:
            runner.prefill(tokens[: p - 1])
        guesses = runner.forward(tokens[p - 1 : -1]).argmax(dim=-1)
        out.append((guesses == tokens[p:]).tolist())
    return out


def evaluate(
    target: LoadedModel,
    skip: tuple[int, ...],
    runs: Sequence[Continuation],
    step: StepCost,
    verify: VerifyCost,
    max_gamma: int,
) -> Candidate:
    """Replay ``runs`` with the view that skips ``skip``: acceptance, and the gamma with the best prediction."""
    accepted = agreement(skipping_model(target, skip), runs)
    tokens = sum(len(a) for a in accepted)
    kept = step.layers - len(skip)
    cost = step.ratio(kept)
    prefill = sum(r.prefill_ms for r in runs) / step.milliseconds(step.layers)
    draft_prefill = prefill * kept / step.layers  # a prefill runs no head but the last row's: its layers' share

    def speedup_at(gamma: int, curve: Callable[[int], float]) -> float:
        rounds = sum(chain_rounds(a, gamma) for a in accepted)
        return predicted_speedup(rounds, tokens, gamma, cost, curve, prefill, draft_prefill)

    gammas = range(1, min(max_gamma, verify.max_k - 1) + 1)
    gamma = max(gammas, key=lambda g: speedup_at(g, verify))
    rounds = sum(chain_rounds(a, gamma) for a in accepted)
    flat = max(speedup_at(g, lambda k: 1.0) for g in range(1, max_gamma + 1))
    return Candidate(skip, sum(map(sum, accepted)) / tokens, tokens / rounds, cost, gamma, speedup_at(gamma, verify),
                     flat)  # fmt: skip


def greedy_path(
    target: LoadedModel,
    runs: Sequence[Continuation],
    step: StepCost,
    verify: VerifyCost,
    settings: SearchSettings,
    on_step: Callable[[Candidate], None] | None = None,
) -> list[Candidate]:
    """The best set of each size 1..max_skip, each the previous one plus the layer whose removal predicts the
    highest speedup (ties: the higher acceptance, then the lower layer)."""
    layers = layer_count(target)
    max_skip = min(settings.max_skip or layers // 2, layers - 1)
    skip: tuple[int, ...] = ()
    path = []
    for _ in range(max_skip):
        best = None
        for layer in range(layers):
            if layer in skip:
                continue
            candidate = evaluate(target, tuple(sorted((*skip, layer))), runs, step, verify, settings.max_gamma)
            if on_step is not None:
                on_step(candidate)
            if best is None or (candidate.predicted, candidate.acceptance) > (best.predicted, best.acceptance):
                best = candidate
        assert best is not None
        path.append(best)
        skip = best.skip
    return path


def finalists(path: Sequence[Candidate], count: int) -> list[Candidate]:
    """The ``count`` sets of the path with the highest predicted speedup, best first."""
    return sorted(path, key=lambda c: (-c.predicted, len(c.skip)))[:count]


@torch.inference_mode()
def step_cost(target: LoadedModel, context: int = 256, repeats: int = 15) -> StepCost:
    """Fit ``fixed + kept * per_layer`` to median one-token forward times of the target and of its first half
    and first layer (interleaved, on a ``context``-token cache)."""
    layers = layer_count(target)
    sizes = sorted({layers, max(1, layers // 2), 1})
    models = {n: target if n == layers else truncated_model(target, n) for n in sizes}
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.vocab_size, (context + 1,), generator=generator)
    runners = {}
    for n, model in models.items():
        runners[n] = model.new_runner()
        runners[n].prefill(tokens[:context])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for sweep in range(repeats + 1):
        for n, runner in runners.items():
            t0 = time.perf_counter()
            runner.forward(tokens[context:])
            elapsed = time.perf_counter() - t0
            runner.rollback_to(context)
            if sweep:
                times[n].append(elapsed * 1e3)
    medians = {n: statistics.median(ts) for n, ts in times.items()}
    xs, ys = list(medians), list(medians.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    per_layer = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    per_layer = max(per_layer, 1e-9)
    fixed = max(mean_y - per_layer * mean_x, 0.0)
    return StepCost(fixed, per_layer, layers)


@dataclass(frozen=True)
class Confirmed:
    """A finalist measured end to end by the bench against plain decoding (greedy, same prompts)."""

    candidate: Candidate
    speedup: float
    tokens_per_second: float
    plain_tokens_per_second: float
    tokens_per_pass: float
    acceptance: float
    draft_cost: float | None
    differing: int  # outputs not identical to plain's: 0 unless something is broken

    def to_json(self) -> dict:
        data = asdict(self)
        data["candidate"] = self.candidate.to_json()
        return data


def confirm(
    target: LoadedModel,
    items: Sequence,
    candidates: Sequence[Candidate],
    max_new_tokens: int,
    on_progress: Callable[[str], None] | None = None,
) -> list[Confirmed]:
    """Run plain and each candidate (at its gamma) on ``items`` through the bench (interleaved, warmed up)."""
    from .methods import build_methods, draft_method
    from .metrics import OVERALL
    from .runner import BenchConfig, run_bench

    plain = build_methods(target, (), transformers=False)
    methods = [
        draft_method(target, f"skip{i}", skipping_model(target, c.skip), c.gamma) for i, c in enumerate(candidates)
    ]
    result = run_bench(
        target, items, plain + methods, BenchConfig(max_new_tokens=max_new_tokens), on_progress=on_progress
    )
    rows = result.aggregates[OVERALL]
    plain_tps = rows[plain[0].name]["tokens_per_second"]
    out = []
    for candidate, method in zip(candidates, methods, strict=True):
        row = rows[method.name]
        out.append(
            Confirmed(
                candidate,
                row["speedup_vs_plain"],
                row["tokens_per_second"],
                plain_tps,
                row["tokens_per_pass"],
                row["acceptance_rate"] or 0.0,
                row["draft_cost"],
                row["non_identical"] or 0,
            )
        )
    return out
