"""The bench loop: every method on every question in one process, interleaved in a rotating order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..models.loaded import LoadedModel
from ..planner import VerifyCost
from ..sampling.params import SamplingParams
from .methods import HF_PLAIN, Method, MethodSpec
from .metrics import TurnRecord, aggregate, mark_identity
from .workloads import WorkItem, build_prompt

WARMUP_TOKENS = 16


@dataclass(frozen=True)
class BenchConfig:
    """Settings shared by every method: the same token budget, sampling and seed."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def params(self, question_index: int, max_new_tokens: int | None = None) -> SamplingParams:
        """The same SamplingParams for every method on a question (seeded per question when sampling)."""
        return SamplingParams(
            temperature=self.temperature,
            seed=self.seed + question_index,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
        )


@dataclass
class BenchResult:
    """Every timed record, the methods compared and the aggregates (see ``metrics.aggregate``)."""

    config: BenchConfig
    methods: list[MethodSpec]
    records: list[TurnRecord]
    aggregates: dict[str, dict[str, dict]]
    verify_cost: dict[int, float] | None = None
    verify_milliseconds: dict[str, dict[int, float]] | None = None  # --verify-curve: median ms per engine (ours, peers)

    @property
    def baselines(self) -> list[str]:
        """Our plain decode (one per quantization setting) and transformers' plain generate, if run."""
        return [m.name for m in self.methods if m.ours_plain or m.name == HF_PLAIN]


def references(specs: Sequence[MethodSpec]) -> dict[str, tuple[str, bool]]:
    """Each method's reference, our plain decode, and whether its greedy outputs must equal it.

    Ours: the plain decode of the same setting (must equal). transformers / llama.cpp: our plain decode on
    the same weights (transformers' must equal it, llama.cpp's numerics differ), else the first one (need not).
    """
    plains = [s for s in specs if s.ours_plain]
    if not plains:
        return {}
    refs = {}
    for spec in specs:
        if spec.family == "ours":
            same = [p for p in plains if p.setting == spec.setting]
        else:
            same = [p for p in plains if p.quantization == spec.quantization]
        exact = bool(same) and spec.family in ("ours", "transformers")
        refs[spec.name] = ((same or plains)[0].name, exact)
    return refs


def rotation(methods: Sequence[Method], index: int) -> list[Method]:
    """The order for question ``index``: the method list rotated by ``index``."""
    shift = index % len(methods) if methods else 0
    return [*methods[shift:], *methods[:shift]]


def _answer(target: LoadedModel, method: Method, item: WorkItem, params: SamplingParams) -> list[TurnRecord]:
    """Every turn of ``item`` with ``method``; later turns see the method's own earlier answers."""
    method.start()
    answers: list[list[int]] = []
    records = []
    for turn in range(len(item.turns)):
        prompt = build_prompt(target, item.turns, answers)
        gen = method.generate(prompt, params)
        answers.append(gen.token_ids)
        records.append(
            TurnRecord(
                item.question_id,
                item.category,
                item.subtask,
                turn,
                method.name,
                len(prompt),
                len(gen.token_ids),
                gen.seconds,
                gen.token_ids,
                gen.stats,
            )
        )
    return records


def run_bench(
    target: LoadedModel,
    items: Sequence[WorkItem],
    methods: Sequence[Method],
    config: BenchConfig = BenchConfig(),
    verify_cost: dict[int, float] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Warm every method up, then for each question run every method (rotating order); aggregate."""
    if not items:
        raise ValueError("no questions to run: check --categories and --limit")
    if not methods:
        raise ValueError("no methods to compare")
    for i, item in enumerate(items[: config.warmup]):
        warm = config.params(i, min(WARMUP_TOKENS, config.max_new_tokens))
        for method in methods:
            _answer(target, method, dataclasses.replace(item, turns=item.turns[:1]), warm)
    for method in methods:
        method.forget()  # a method that remembers questions (suffix decoding) must not know the warm-up's
    records: list[TurnRecord] = []
    for i, item in enumerate(items):
        params = config.params(i)
        for method in rotation(methods, i):
            records += _answer(target, method, item, params)
            if on_progress is not None:
                on_progress(f"{item.subtask} #{item.question_id} {method.name}")
    names = [m.name for m in methods]
    specs = [m.spec for m in methods]
    refs = references(specs)
    plain = {m: ref for m, (ref, _) in refs.items()} or names[0]
    exact = {m for m, (_, must) in refs.items() if must}
    if not config.greedy:  # sampled: only reproducible mode (and plain itself) promises plain sampling's tokens
        exact = {s.name for s in specs if s.name in exact and (s.ours_plain or s.mode == "reproducible")}
    if refs:
        mark_identity(records, plain if config.greedy else {m: r for m, r in plain.items() if m in exact})
    gammas = {s.name: s.gamma for s in specs if s.family == "ours"}
    curve = None if verify_cost is None else VerifyCost.from_json({str(k): v for k, v in verify_cost.items()})
    aggregates = aggregate(records, names, gammas, plain, HF_PLAIN if HF_PLAIN in names else None, curve, exact)
    return BenchResult(config, specs, records, aggregates, verify_cost)
