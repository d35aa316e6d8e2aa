"""Bench arithmetic, pure over records: per-question tokens/s, means, speedups, acceptance, draft cost."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..engine.stats import DecodeStats
from ..planner import VerifyCost, speedup

OVERALL = "overall"


@dataclass
class TurnRecord:
    """One timed generation: a method answering one turn of one question."""

    question_id: int | str
    category: str
    subtask: str
    turn: int
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    token_ids: list[int] = field(default_factory=list)
    stats: DecodeStats | None = None
    identical: bool | None = None

    def to_dict(self) -> dict:
        return {
            "question_id": self.question_id,
            "category": self.category,
            "subtask": self.subtask,
            "turn": self.turn,
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.new_tokens / self.seconds if self.seconds > 0 else None,
            "identical_to_plain": self.identical,
            "token_ids": self.token_ids,
            "stats": None if self.stats is None else self.stats.to_dict(),
        }


def mean(values: Iterable[float]) -> float | None:
    """Arithmetic mean; None for no values."""
    values = list(values)
    return math.fsum(values) / len(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None if either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def question_tokens_per_second(records: Sequence[TurnRecord]) -> dict[tuple[str, int | str], float]:
    """Spec-Bench's per-question speed: Σ new tokens / Σ wall seconds over a question's turns, per method."""
    tokens: dict[tuple[str, int | str], int] = {}
    seconds: dict[tuple[str, int | str], float] = {}
    for r in records:
        key = (r.method, r.question_id)
        tokens[key] = tokens.get(key, 0) + r.new_tokens
        seconds[key] = seconds.get(key, 0.0) + r.seconds
    return {key: tokens[key] / seconds[key] for key in tokens if seconds[key] > 0}


def mean_tokens_per_second(records: Sequence[TurnRecord], method: str) -> float | None:
    """Mean over questions of per-question tokens/s (prefill included) for one method."""
    per_question = question_tokens_per_second([r for r in records if r.method == method])
    return mean(per_question.values())


def mean_decode_tokens_per_second(records: Sequence[TurnRecord], method: str) -> float | None:
    """Mean over questions of tokens / (wall − prefill) seconds: the part of the time the planner models."""
    tokens: dict[int | str, int] = {}
    seconds: dict[int | str, float] = {}
    for r in records:
        if r.method != method or r.stats is None:
            continue
        tokens[r.question_id] = tokens.get(r.question_id, 0) + r.new_tokens
        seconds[r.question_id] = seconds.get(r.question_id, 0.0) + r.seconds - r.stats.prefill_seconds
    return mean(tokens[q] / seconds[q] for q in tokens if seconds[q] > 0)


def merged_stats(records: Iterable[TurnRecord]) -> DecodeStats | None:
    """Sum of the records' DecodeStats (None when no record has stats, e.g. transformers' generate)."""
    total = None
    for r in records:
        if r.stats is not None:
            total = r.stats if total is None else total.merge(r.stats)
    return total


def target_step_seconds(plain: DecodeStats | None) -> float | None:
    """Seconds of one 1-token target step, from plain decoding's stats (verify seconds per pass)."""
    if plain is None or not plain.rounds:
        return None
    return plain.verify_seconds / plain.rounds


def draft_cost_ratio(spec: DecodeStats | None, step_seconds: float | None) -> float | None:
    """c = (draft seconds per drafted token) / (target seconds per 1-token step)."""
    if spec is None or not spec.drafted or not step_seconds:
        return None
    return (spec.draft_seconds / spec.drafted) / step_seconds


def pass_split(stats: DecodeStats | None, step_seconds: float | None) -> dict[str, float | None]:
    """Per target pass: drafted tokens (a tree's size), milliseconds drafting and verifying, and the verify
    pass relative to a plain 1-token step (the measured v at this method's pass size)."""
    if stats is None or not stats.rounds:
        return {"drafted_per_pass": None, "draft_ms_per_pass": None, "verify_ms_per_pass": None, "verify_ratio": None}
    verify = stats.verify_seconds / stats.rounds
    return {
        "drafted_per_pass": stats.drafted / stats.rounds,
        "draft_ms_per_pass": 1e3 * stats.draft_seconds / stats.rounds,
        "verify_ms_per_pass": 1e3 * verify,
        "verify_ratio": ratio(verify, step_seconds),
    }


def other_share(stats: DecodeStats | None) -> float | None:
    """Fraction of wall time outside prefill, drafting and verification."""
    if stats is None or not stats.total_seconds:
        return None
    return stats.other_seconds / stats.total_seconds


def predicted_speedup(
    alpha: float | None, gamma: int | None, cost: float | None, verify_cost: VerifyCost | None = None
) -> float | None:
    """The planner's E(α, γ) / (v(γ+1) + γc) (v = 1 without a measured curve); None if not computable."""
    if alpha is None or gamma is None or cost is None:
        return None
    if verify_cost is not None and gamma + 1 > verify_cost.max_k:
        verify_cost = None
    return speedup(alpha, gamma, cost, verify_cost)


def predicted_from_drafted(
    stats: DecodeStats | None, cost: float | None, verify_cost: VerifyCost | None
) -> float | None:
    """The planner's ratio with the measured acceptance process: tokens/pass / (v(k̄+1) + k̄c), k̄ = drafted/pass.

    Unlike E(α, γ) it holds for proposers that draft fewer than γ tokens (prompt lookup without a match).
    v = 1 without a measured curve; None past its end (a pass larger than the curve measured).
    """
    if stats is None or not stats.rounds or cost is None:
        return None
    drafted = stats.drafted / stats.rounds
    if verify_cost is not None and drafted + 1 > verify_cost.max_k:
        return None
    verify = 1.0 if verify_cost is None else verify_cost(drafted + 1)
    return stats.tokens_per_round / (verify + drafted * cost)


def count_non_identical(records: Iterable[TurnRecord]) -> int | None:
    """How many records differ from our plain decode (None when no identity check was made)."""
    checked = [r.identical for r in records if r.identical is not None]
    return sum(not same for same in checked) if checked else None


def count_identical(records: Iterable[TurnRecord]) -> int | None:
    """How many records equal our plain decode (None when no identity check was made)."""
    checked = [r.identical for r in records if r.identical is not None]
    return sum(checked) if checked else None


def mark_identity(records: Sequence[TurnRecord], reference: str | Mapping[str, str]) -> None:
    """Set ``identical`` on every record: same token ids as its reference method for that turn.

    ``reference`` is one method for all, or a method → reference map (methods not in it get None).
    """
    refs = reference if isinstance(reference, Mapping) else {r.method: reference for r in records}
    wanted = set(refs.values())
    ids = {(r.method, r.question_id, r.turn): r.token_ids for r in records if r.method in wanted}
    for r in records:
        key = (refs.get(r.method), r.question_id, r.turn)
        r.identical = None if key not in ids else r.token_ids == ids[key]


def aggregate(
    records: Sequence[TurnRecord],
    methods: Sequence[str],
    gammas: Mapping[str, int | None],
    plain: str | Mapping[str, str],
    hf_plain: str | None = None,
    verify_cost: VerifyCost | None = None,
    exact: Collection[str] | None = None,
) -> dict[str, dict[str, dict]]:
    """Figures per subtask (and ``overall``) and method: speed, speedups, acceptance, costs, prediction.

    ``plain``: our plain decode every method is measured against (one for all, or a method → plain map);
    ``exact``: the methods whose greedy outputs must equal it (default: all); the others' differences are
    not counted as ``non_identical``, only their matches reported as ``same_as_plain``.
    """
    refs = plain if isinstance(plain, Mapping) else {m: plain for m in methods}
    subtasks = sorted({r.subtask for r in records})
    out: dict[str, dict[str, dict]] = {}
    for subtask in [*subtasks, OVERALL]:
        group = [r for r in records if subtask == OVERALL or r.subtask == subtask]
        plain_tps = {p: mean_tokens_per_second(group, p) for p in set(refs.values())}
        plain_decode_tps = {p: mean_decode_tokens_per_second(group, p) for p in plain_tps}
        step = {p: target_step_seconds(merged_stats(r for r in group if r.method == p)) for p in plain_tps}
        hf_tps = mean_tokens_per_second(group, hf_plain) if hf_plain else None
        rows = {}
        for method in methods:
            mine = [r for r in group if r.method == method]
            if not mine:
                continue
            ref = refs.get(method)
            stats = merged_stats(mine)
            tps = mean_tokens_per_second(group, method)
            cost = draft_cost_ratio(stats, step.get(ref))
            gamma = gammas.get(method)
            alpha = stats.alpha if stats is not None and stats.drafted else None
            rows[method] = {
                "questions": len({r.question_id for r in mine}),
                "turns": len(mine),
                "new_tokens": sum(r.new_tokens for r in mine),
                "plain": ref,
                "tokens_per_second": tps,
                "speedup_vs_plain": ratio(tps, plain_tps.get(ref)),
                "speedup_vs_hf_plain": ratio(tps, hf_tps),
                "tokens_per_pass": None if stats is None else stats.tokens_per_round,
                "acceptance_rate": None if stats is None or not stats.drafted else stats.acceptance_rate,
                "alpha": alpha,
                "per_position": None if stats is None or not stats.drafted else stats.per_position_rate,
                "non_identical": count_non_identical(mine) if exact is None or method in exact else None,
                "same_as_plain": count_identical(mine),
                "other_share": other_share(stats),
                "draft_cost": cost,
                "predicted_speedup": predicted_speedup(alpha, gamma, cost, verify_cost),
                "decode_speedup_vs_plain": ratio(
                    mean_decode_tokens_per_second(group, method), plain_decode_tps.get(ref)
                ),
                "predicted_from_drafted": predicted_from_drafted(stats, cost, verify_cost),
                **pass_split(stats, step.get(ref)),
            }
        out[subtask] = rows
    return out
