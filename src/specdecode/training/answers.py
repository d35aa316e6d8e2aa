"""The target's own answers to training prompts: the text a draft head meets when it drafts (SpecForge's recipe
regenerates ShareGPT's answers with the target for the same reason).

Each prompt is a chat's first user turn (ShareGPT, a JSONL/JSON file of chats, or a folder; Spec-Bench questions
are never used), or, with ``prompts="self"``, a question the target wrote itself (``training.questions``: written
first to ``out/questions.jsonl``, ``limit + skip`` of them, then answered like a file of questions). Answers come
from our own serving engine (``serving.batching.scheduler``): up to ``batch`` requests decoded together, speculating
with prompt lookup where it pays, in reproducible mode — answer i is what plain decoding gives with seed ``seed + i``
(greedy at temperature 0), whatever the batch. ``batching="padded"`` answers up to ``batch`` prompts in one
left-padded tensor instead (``training.padded``: what keeps a GPU busy; greedy without a bitwise promise, sampled rows
drawing from one generator per batch). Each finished answer is one JSON line, written as it ends:
``{"messages": [user, assistant], "index", "finish_reason", "tokens", "seed"}``, which ``train-head --data`` reads
as a chat. A run that stops is resumed by running it again: the prompts already answered are skipped (a line cut
off by the stop is dropped first).
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..engine.decoder import SpeculativeDecoder
from ..engine.request import Request, check_context_window
from ..models.loaded import LoadedModel
from ..proposers import PromptLookupProposer
from ..sampling.params import SamplingParams
from .data import (
    HELD_OUT,
    DataStats,
    drop_cut_last_line,
    first_user_turn,
    iter_jsonl,
    iter_samples,
    spec_bench_questions,
)
from .questions import QUESTIONS_FILE, QuestionSettings, QuestionStats, write_questions

ANSWERS_FILE = "answers.jsonl"
PROPOSERS = ("lookup", "none")
BATCHINGS = ("engine", "padded")
SELF = "self"  # prompts the target writes itself (training.questions)
PADDED_TOKENS = 1 << 18  # most (prompt + answer) tokens in one padded batch: ~12 GB of float32 KV for smollm2


@dataclass(frozen=True)
class AnswerSettings:
    """What ``make_answers`` generates: from which prompts, how many, how long, how sampled, how batched."""

    prompts: str = "sharegpt"
    limit: int | None = None  # prompts to answer (after skipping unusable ones); None = all
    skip: int = 0  # prompts left out after the first HELD_OUT (answered by an earlier run, or seen by a head)
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0  # answer i samples with seed + i
    batch: int = 8  # requests decoded together
    proposer: str = "lookup"  # speculation for speed ("none": plain decoding); never changes an answer
    spec_bench: str | None = None  # Spec-Bench question.jsonl to exclude (default: the project's copy if present)
    batching: str = "engine"  # "padded": up to `batch` prompts in one left-padded tensor (training.padded; GPUs)
    max_prompt_tokens: int | None = None  # longer prompts (chat template applied) are skipped as too long
    question_temperature: float = 1.0  # prompts="self": the temperature the target writes its questions at

    def __post_init__(self) -> None:
        if self.prompts == SELF and self.limit is None:
            raise ValueError("prompts 'self' needs a limit: the number of questions the target writes and answers")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"limit must be a positive integer or None, got {self.limit!r}")
        if not isinstance(self.skip, int) or self.skip < 0:
            raise ValueError(f"skip must be a non-negative integer, got {self.skip!r}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive integer, got {self.batch!r}")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        if self.max_prompt_tokens is not None and (
            isinstance(self.max_prompt_tokens, bool)
            or not isinstance(self.max_prompt_tokens, int)
            or self.max_prompt_tokens < 1
        ):
            raise ValueError(f"max_prompt_tokens must be a positive integer or None, got {self.max_prompt_tokens!r}")
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {', '.join(BATCHINGS)}, got {self.batching!r}")
        SamplingParams(self.temperature, 0, self.top_p, self.max_new_tokens, self.seed)  # validates the rest

    def fits(self, target: LoadedModel, prompt_ids: list[int]) -> bool:
        """Whether a prompt is answered: within ``max_prompt_tokens`` and, with its answer, the context window."""
        if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
            return False
        try:
            check_context_window(target, len(prompt_ids), self.max_new_tokens)
        except ValueError:
            return False
        return True

    def params(self, index: int) -> SamplingParams:
        return SamplingParams(self.temperature, 0, self.top_p, self.max_new_tokens, self.seed + index)

    def questions(self) -> QuestionSettings:
        """prompts="self": the questions to write, ``limit + skip`` (the skipped ones are written, not answered)."""
        return QuestionSettings(
            count=(self.limit or 0) + self.skip,
            temperature=self.question_temperature,
            seed=self.seed,
            batch=self.batch,
            batching=self.batching,
            spec_bench=self.spec_bench,
        )


@dataclass
class AnswerStats:
    """What a run did: prompts found, answered now, answered by earlier runs, skipped (too long) or failed."""

    prompts: int = 0
    answered: int = 0
    already: int = 0
    too_long: int = 0
    failed: int = 0
    tokens: int = 0
    excluded: int = 0  # Spec-Bench conversations dropped
    errors: list[str] = field(default_factory=list)


def training_prompts(settings: AnswerSettings, stats: AnswerStats) -> list[tuple[int, str]]:
    """(index, first user turn) of the chats of ``settings.prompts`` (in the user's files, chats of a user turn
    alone count too), up to ``limit`` of them; plain texts are
    skipped, and so are the ``skip`` prompts after the first ``HELD_OUT`` (indices stay those of the whole list, so
    runs with and without ``skip`` write the same line for a prompt)."""
    reader = DataStats()
    prompts: list[tuple[int, str]] = []
    index = -1
    for sample in iter_samples(settings.prompts, spec_bench_questions(settings.spec_bench), reader, questions=True):
        question = None if isinstance(sample, str) else first_user_turn(sample)
        if question and question.strip():
            index += 1
            if HELD_OUT <= index < HELD_OUT + settings.skip:
                continue
            prompts.append((index, question))
            if settings.limit is not None and len(prompts) >= settings.limit:
                break
    stats.prompts, stats.excluded = len(prompts), reader.excluded
    if not prompts:
        raise ValueError(f"{settings.prompts} holds no chats with a user turn to answer")
    ran_out = settings.limit is None or len(prompts) < settings.limit
    if settings.skip and ran_out and prompts[-1][0] < HELD_OUT + settings.skip:
        raise ValueError(
            f"{settings.prompts} holds {index + 1} chats with a user turn: skipping {settings.skip} after the first "
            f"{HELD_OUT} leaves none to answer"
        )
    return prompts


def answered_indices(path: Path) -> set[int]:
    """The indices already in ``path``; a last line cut off by an interrupted run is removed from the file."""
    if not path.is_file():
        return set()
    drop_cut_last_line(path)
    return {int(record["index"]) for record in iter_jsonl(path) if isinstance(record, dict) and "index" in record}


def make_answers(
    target: LoadedModel,
    settings: AnswerSettings,
    out: str | Path,
    on_answer: Callable[[AnswerStats], None] | None = None,
    on_start: Callable[[AnswerStats], None] | None = None,
    on_question: Callable[[QuestionStats], None] | None = None,
) -> AnswerStats:
    """Answer every prompt of ``settings`` not yet in ``out/answers.jsonl`` with ``target``; return the counts.
    With ``prompts="self"`` the target first writes its questions to ``out/questions.jsonl`` (``on_question``
    after each one kept)."""
    if target.tokenizer is None:
        raise ValueError("make-data needs the target's tokenizer (prompts are text)")
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    if settings.prompts == SELF:
        write_questions(target, settings.questions(), folder / QUESTIONS_FILE, on_question)
        settings = replace(settings, prompts=str(folder / QUESTIONS_FILE))
    path = folder / ANSWERS_FILE
    stats = AnswerStats()
    done = answered_indices(path)
    todo = [(i, q) for i, q in training_prompts(settings, stats) if i not in done]
    stats.already = stats.prompts - len(todo)
    if on_start is not None:
        on_start(stats)
    if settings.batching == "padded":
        with open(path, "a", encoding="utf-8") as file:
            _answer_padded(target, todo, settings, stats, file, on_answer)
        return stats
    from ..serving.batching.policy import SpeculationPolicy  # here: importing serving loads FastAPI
    from ..serving.batching.scheduler import PLAIN, Event, Job, Scheduler, Speculation

    decoder = SpeculativeDecoder(target, None, gamma="auto", mode="reproducible")
    proposers = {} if settings.proposer == "none" else {"lookup": PromptLookupProposer}
    scheduler = Scheduler(decoder, proposers, SpeculationPolicy("auto"), max_batch=settings.batch)
    speculation = Speculation(PLAIN if settings.proposer == "none" else "lookup", "auto")
    finished: queue.SimpleQueue[tuple[int, str, Event]] = queue.SimpleQueue()
    pending = _requests(target, todo, settings, stats)
    in_flight = 0
    scheduler.start()
    try:
        with open(path, "a", encoding="utf-8") as file:
            while True:
                while in_flight < 2 * settings.batch and (item := next(pending, None)) is not None:
                    index, question, request = item
                    deliver = _collector(finished, index, question)
                    scheduler.submit(Job(request, speculation, deliver))
                    in_flight += 1
                if not in_flight:
                    break
                index, question, event = finished.get()
                in_flight -= 1
                if event.kind == "error":
                    stats.failed += 1
                    stats.errors.append(f"prompt {index}: {event.error}")
                else:
                    output = event.output
                    _write(file, index, question, output.text, output.finish_reason, output.token_ids, output.seed)
                    stats.answered += 1
                    stats.tokens += len(output.token_ids)
                if on_answer is not None:
                    on_answer(stats)
    finally:
        scheduler.stop()
    return stats


def _write(file, index: int, question: str, text: str, finish_reason: str, token_ids: list[int], seed) -> None:
    record = {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": text}],
        "index": index,
        "finish_reason": finish_reason,
        "tokens": len(token_ids),
        "seed": seed,
    }
    file.write(json.dumps(record, ensure_ascii=False) + "\n")
    file.flush()


def padded_batches(lengths: list[int], batch: int, max_new_tokens: int) -> list[list[int]]:
    """Positions of ``lengths`` (prompt lengths, in prompt order) grouped for padded decoding: windows of 8 batches
    taken in order, each sorted by length (less padding) and cut into batches of at most ``batch`` rows whose padded
    size, rows × (longest prompt + ``max_new_tokens``), stays within ``PADDED_TOKENS`` (a lone prompt past it still
    gets its own batch). A run stopped early has answered every window before the one it was in and that window's
    shorter prompts."""
    groups: list[list[int]] = []
    window = 8 * batch
    for start in range(0, len(lengths), window):
        order = sorted(range(start, min(start + window, len(lengths))), key=lambda i: (lengths[i], i))
        current: list[int] = []
        for i in order:  # ascending length: the newest prompt is the longest of its batch
            rows = len(current) + 1
            if current and (rows > batch or rows * (lengths[i] + max_new_tokens) > PADDED_TOKENS):
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
    return groups


def _answer_padded(target: LoadedModel, todo, settings: AnswerSettings, stats: AnswerStats, file, on_answer) -> None:
    """Answer ``todo`` in left-padded batches (``training.padded``); answer i's record carries the batch's seed."""
    from .padded import answer_padded

    fitting = []
    for index, question in todo:
        ids = target.chat_prompt(question)
        if not settings.fits(target, ids):
            stats.too_long += 1
            continue
        fitting.append((index, question, ids))
    pad_id = min(target.eos_token_ids) if target.eos_token_ids else 0
    for group in padded_batches([len(ids) for _, _, ids in fitting], settings.batch, settings.max_new_tokens):
        rows = [fitting[i] for i in group]
        params = settings.params(rows[0][0])
        try:
            answers = answer_padded(
                target.model, [ids for _, _, ids in rows], params, target.eos_token_ids, target.vocab_size, pad_id
            )
        except (RuntimeError, ValueError) as error:  # e.g. out of GPU memory: these prompts fail, the run goes on
            stats.failed += len(rows)
            stats.errors.append(f"prompts {', '.join(str(i) for i, _, _ in rows)}: {error}")
            continue
        for (index, question, _), answer in zip(rows, answers, strict=True):
            text = target.decode(answer.token_ids)
            _write(file, index, question, text, answer.finish_reason, answer.token_ids, params.seed)
            stats.answered += 1
            stats.tokens += len(answer.token_ids)
            if on_answer is not None:
                on_answer(stats)


def _collector(finished: queue.SimpleQueue, index: int, question: str) -> Callable:
    def deliver(event) -> None:
        if event.kind != "text":
            finished.put((index, question, event))

    return deliver


def _requests(
    target: LoadedModel, todo: list[tuple[int, str]], settings: AnswerSettings, stats: AnswerStats
) -> Iterator[tuple[int, str, Request]]:
    """Each prompt's engine request (its chat template applied); prompts that do not fit (``settings.fits``) are
    counted and skipped."""
    for index, question in todo:
        ids = target.chat_prompt(question)
        if not settings.fits(target, ids):
            stats.too_long += 1
            continue
        yield index, question, Request(target, ids, settings.params(index), None)
