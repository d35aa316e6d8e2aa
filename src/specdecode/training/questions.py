"""Questions the target writes itself, for make-data (``--prompts self``; the "pre-query template" idea of Magpie,
Xu et al. 2024): the chat template up to where a user's text would begin, sampled until the turn ends. An instruct
model then writes the kind of request it was tuned to answer: chat-shaped prompts, unlike ShareGPT's long pastes.

Sample i is drawn with seed + i (``batching="engine"``: plain decoding, the same questions on every run) or in
left-padded batches of ``batch`` rows, a batch's rows drawing from one generator seeded by its first sample's
seed (``training.padded``: what keeps a GPU busy). Kept: questions that ended (an end-of-turn id, not the token
budget) with ``min_words``..``max_words`` words, not a repeat of a kept one and not a Spec-Bench question (both
compared normalised). Each kept question is one JSON line, a chat of a user turn alone,
``{"messages": [user], "sample", "seed"}``; a stopped run resumes after the last sample in the file (a line cut off
by the stop is dropped first): in engine batching the file is then the one an uninterrupted run writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..engine.decoder import autoregressive_generate
from ..models.loaded import LoadedModel
from ..sampling.params import SamplingParams
from .data import drop_cut_last_line, iter_jsonl, normalise, spec_bench_questions

QUESTIONS_FILE = "questions.jsonl"
SAMPLES_PER_QUESTION = 50  # a run that needs more samples than this per question asked for stops with an error
_PROBE = "\x00PROBE\x00"


@dataclass(frozen=True)
class QuestionSettings:
    """How many questions the target writes, how they are sampled and batched, and which are kept."""

    count: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 96  # a question longer than this is dropped as unfinished
    seed: int = 0
    min_words: int = 4
    max_words: int = 120
    batch: int = 64  # rows of a padded batch
    batching: str = "engine"  # or "padded"
    spec_bench: str | None = None  # Spec-Bench question.jsonl to exclude (default: the project's copy if present)

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"the number of questions must be a positive integer, got {self.count!r}")
        if not self.temperature > 0:
            raise ValueError(f"questions are sampled: their temperature must be > 0, got {self.temperature!r}")
        if not 1 <= self.min_words <= self.max_words:
            raise ValueError(f"need 1 <= min_words <= max_words, got {self.min_words!r}, {self.max_words!r}")
        if self.batching not in ("engine", "padded"):
            raise ValueError(f"batching must be engine or padded, got {self.batching!r}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive integer, got {self.batch!r}")
        self.params(0)  # validates top_p and max_new_tokens

    def params(self, sample: int) -> SamplingParams:
        return SamplingParams(self.temperature, 0, self.top_p, self.max_new_tokens, self.seed + sample)


@dataclass
class QuestionStats:
    """What a run did: samples drawn, questions kept (now and before), and why the others were dropped."""

    samples: int = 0
    kept: int = 0
    already: int = 0
    unfinished: int = 0  # ran out of max_new_tokens
    wrong_length: int = 0  # outside min_words..max_words
    repeats: int = 0
    excluded: int = 0  # Spec-Bench questions


def pre_query_ids(target: LoadedModel) -> list[int]:
    """The chat template's ids before a user turn's text: a probe user turn rendered, cut where the probe begins."""
    template = getattr(target.tokenizer, "chat_template", None) if target.tokenizer is not None else None
    if not template:
        raise ValueError("the target has no chat template: it cannot be asked to write a user's question")
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False)
    before = text[: text.index(_PROBE)]
    if not before.strip():
        raise ValueError("the target's chat template puts nothing before a user's text: nothing to write from")
    return target.encode(before)


def write_questions(
    target: LoadedModel,
    settings: QuestionSettings,
    path: str | Path,
    on_question: Callable[[QuestionStats], None] | None = None,
) -> QuestionStats:
    """Append questions the target writes to ``path`` until it holds ``settings.count``; return the counts."""
    if target.tokenizer is None:
        raise ValueError("writing questions needs the target's tokenizer")
    path = Path(path).expanduser()
    records = []
    if path.is_file():
        drop_cut_last_line(path)
        records = [r for r in iter_jsonl(path) if isinstance(r, dict) and "sample" in r]
    seen = {normalise(r["messages"][0]["content"]) for r in records}
    stats = QuestionStats(already=len(seen))
    next_sample = max((int(r["sample"]) + 1 for r in records), default=0)
    prefix = pre_query_ids(target)
    spec_bench = spec_bench_questions(settings.spec_bench) or frozenset()
    runner = target.new_runner() if settings.batching == "engine" else None
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as file:
        while len(seen) < settings.count:
            if stats.samples >= SAMPLES_PER_QUESTION * settings.count + 100:
                raise ValueError(
                    f"the target wrote {stats.kept} usable questions in {stats.samples} samples ({stats.unfinished} "
                    f"unfinished, {stats.wrong_length} outside {settings.min_words}-{settings.max_words} words, "
                    f"{stats.repeats} repeats): raise the temperature or max_new_tokens, or ask for fewer"
                )
            width = 1 if runner is not None else min(settings.batch, 2 * (settings.count - len(seen)))
            for sample, (text, finished, seed) in enumerate(
                _samples(target, prefix, settings, next_sample, width, runner), start=next_sample
            ):
                if len(seen) == settings.count:  # a padded batch's rows past the count are not looked at
                    break
                stats.samples += 1
                question = text.strip()
                key = normalise(question)
                if not finished:
                    stats.unfinished += 1
                elif not settings.min_words <= len(question.split()) <= settings.max_words:
                    stats.wrong_length += 1
                elif key in seen:
                    stats.repeats += 1
                elif key in spec_bench:
                    stats.excluded += 1
                else:
                    seen.add(key)
                    record = {"messages": [{"role": "user", "content": question}], "sample": sample, "seed": seed}
                    file.write(json.dumps(record, ensure_ascii=False) + "\n")
                    file.flush()
                    stats.kept += 1
                    if on_question is not None:
                        on_question(stats)
            next_sample += width
    return stats


def _samples(
    target: LoadedModel, prefix: list[int], settings: QuestionSettings, first: int, width: int, runner
) -> list[tuple[str, bool, int]]:
    """(text, ended at an end-of-turn id, seed) of samples ``first``..``first + width - 1``."""
    if runner is not None:
        params = settings.params(first)
        out = autoregressive_generate(target, prefix, params, runner=runner)
        return [(out.text, out.finish_reason == "eos", params.seed)]
    from .padded import answer_padded

    params = settings.params(first)
    pad_id = min(target.eos_token_ids) if target.eos_token_ids else 0
    rows = answer_padded(target.model, [prefix] * width, params, target.eos_token_ids, target.vocab_size, pad_id)
    return [(target.decode(row.token_ids), row.finish_reason == "eos", params.seed) for row in rows]
