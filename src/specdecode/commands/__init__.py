"""The CLI's commands, one module each (registered by ``specdecode.cli``), and the helpers they share (models and
proposers from CLI words come from ``specdecode.factory``, re-exported here)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from enum import Enum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from specdecode import factory
from specdecode.errors import SpecDecodeError
from specdecode.factory import load as load
from specdecode.factory import parse_quantization as parse_quantization
from specdecode.factory import suffix_proposer as suffix_proposer

err = Console(stderr=True)
TARGET_HELP = "Target model: a bundled name (smollm2, gemma3-270m), an HF folder or a .gguf file."
THREADS_HELP = (
    "Torch threads (default: torch's, one per core). Training is bit-for-bit reproducible at a given count; "
    "--resume needs the count the run started with."
)
TOKENS_HELP = "Stop reading training data once it holds N tokens (to compare data sources at equal tokens)."
CACHE_HELP = (
    "Most disk, in GB, for the target's features cached in OUT/features (2 bytes a dimension a token: ~1.2 GB a "
    "million tokens for smollm2); past it features are recomputed each epoch instead (slower, same weights). "
    "0 = cache none, inf = no bound."
)
DEVICE_HELP = "Where the target's features and the training are computed: cpu, or cuda[:N] on a machine with a GPU."


def cache_bytes(gigabytes: float) -> int | None:
    """``--cache-gb`` in bytes (inf: None, unbounded); a negative size is a user's mistake, refused in one line."""
    if not gigabytes >= 0:
        raise typer.BadParameter(f"must be >= 0, got {gigabytes}", param_hint="--cache-gb")
    return None if gigabytes == float("inf") else int(gigabytes * 1e9)


def cache_summary(data: dict[str, Any]) -> str:
    """One line on the training run's feature cache (from its result's ``data``)."""
    line = f"features cached on disk: {data['features_cached_bytes'] / 1e9:.2f} GB"
    missed = data["sequences_not_cached"]
    return line + (f"; {missed:,} sequences past --cache-gb were recomputed each epoch" if missed else "")


def set_threads(threads: int | None) -> None:
    """Torch's thread count from ``--threads`` (None: leave torch's default), refused below 1."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


USER_ERRORS = (SpecDecodeError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError)


@contextmanager
def user_errors(code: int = 1, kinds: tuple[type[Exception], ...] = USER_ERRORS) -> Iterator[None]:
    """Report a user mistake as one line on stderr (never wrapped nor read as markup) and exit with ``code``."""
    try:
        yield
    except kinds as exc:
        err.print(Text.assemble(("error:", "red"), f" {exc}"), soft_wrap=True)
        raise typer.Exit(code) from None


def usage_errors() -> AbstractContextManager[None]:
    """Report a ValueError as a usage error: one line on stderr and exit code 2, as for a bad option."""
    return user_errors(2, (ValueError,))


def friendly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a user mistake into one red line on stderr and exit code 1, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with user_errors():
                return command(*args, **kwargs)
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None

    return wrapper


class ProposerChoice(str, Enum):
    draft = "draft"
    lookup = "lookup"
    eagle = "eagle"
    medusa = "medusa"
    suffix = "suffix"
    eagle_suffix = "eagle+suffix"
    eagle_lookup = "eagle+lookup"
    none = "none"


def quiet_transformers() -> None:
    """Silence transformers' info/warning chatter on the terminal (errors still show)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


# The weight options of the commands that load a target (generate, demo, check-exact), worded once.
DtypeOption = Annotated[
    str,
    typer.Option(
        help="Dense weights' dtype: auto (an HF folder's own, bfloat16 for a bfloat16 or float16 checkpoint, never a "
        "float32 copy of it; float32 for a GGUF file's dense path), float32 or bfloat16."
    ),
]
QuantizationOption = Annotated[
    str,
    typer.Option(
        help="Weights: auto (a GGUF file's own blocks where the native runner runs it, else dense), gguf, "
        "gguf-a8 (the same blocks with int8 activations: llama.cpp's numerics, flatter verify cost, a little less "
        "exact), int8, int4 (groups of --group-size) or none (dense in --dtype: the float32 reference)."
    ),
]
GroupSizeOption = Annotated[int, typer.Option(help="int4: weights per quantization group (32, 64, 128 or 256).")]
MAX_CONTEXT_HELP = (
    "Most tokens a sequence may hold, prompt and output together (default: the model's context window): the KV "
    "cache stops there, a longer request is refused, and a model whose weights and one such sequence do not fit "
    "the memory available is refused before its weights are read."
)
MaxContextOption = Annotated[int | None, typer.Option(min=1, help=MAX_CONTEXT_HELP)]
# The draft model's option, worded once (generate, bench, check-exact, serve, bench-serve).
DraftOption = Annotated[
    str | None,
    typer.Option(
        help="Draft model for --proposer draft (a bundled name, an HF folder or a .gguf file), self:N for the "
        "target's first N layers (an untrained early exit), or skip:SKIP.json (from tune-skip) / skip:3,5,9-12 for "
        "the target without those layers."
    ),
]
# The EAGLE proposer's options, worded once.
HeadOption = Annotated[
    str | None,
    typer.Option(help="--proposer eagle: a head trained with train-head (default: the one shipped for the target)."),
]
TreeNodesOption = Annotated[
    int | None,
    typer.Option(
        help="--proposer eagle, medusa or suffix: nodes of the token tree, 0 = a chain (default: the proposer's)."
    ),
]
HeadsOption = Annotated[
    str | None,
    typer.Option(help="--proposer medusa: heads trained with train-medusa (default: the ones shipped for the target)."),
]
SuffixCacheOption = Annotated[
    str | None,
    typer.Option(
        help="--proposer suffix: a history file (built by `specdecode index` from a corpus, or by earlier runs): "
        "loaded if it exists, and this run's prompts and answers are added to it."
    ),
]


def parse_gamma(text: str) -> int | str:
    """``auto`` or a positive integer, from the command line."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--gamma must be an integer >= 1 or auto, got {text!r}")
    return int(text)


def build_proposer(*args: Any, **kwargs: Any) -> Any:
    """``factory.build_proposer``, a draft model loading with this package's ``load`` (so that what replaces
    ``commands.load``, as tests do, loads the draft too)."""
    return factory.build_proposer(*args, loader=load, **kwargs)


def progress_bar(label: str, info: str = ""):
    """A rich bar on stderr (``label``, count, an ``info`` field, elapsed and remaining time), shown on a terminal
    only; returns (bar, its one task)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn(f"[bold]{label}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
    )
    bar = Progress(*columns, TimeElapsedColumn(), TimeRemainingColumn(), console=err, disable=not err.is_terminal)
    return bar, bar.add_task(label, total=None, info=info)


def training_reporter(max_length: int, accuracy_label: str = "acc"):
    """(bar, on_start, on_step) for a head trainer (``training.train`` / ``training.medusa`` callbacks): the data read,
    then loss and accuracy per step on the bar, or a log line a minute (and at checkpoints) off a terminal."""
    import time

    bar, task = progress_bar("training", "reading data")
    last_log = [0.0]

    def on_start(total: int, done: int, stats) -> None:
        bar.update(task, total=total, completed=done, info="")
        excluded = (
            f"{stats.excluded} Spec-Bench conversations excluded"
            if stats.spec_bench_checked
            else "Spec-Bench file not found: nothing excluded"
        )
        err.print(
            f"{stats.samples} samples read ({excluded}), {stats.sequences} sequences of at most {max_length} tokens; "
            f"{total} steps, {done} done",
            soft_wrap=True,
        )

    def on_step(p) -> None:
        info = f"loss {p.loss:.3f} {accuracy_label} {p.accuracy:.2f} {p.tokens:,} tok"
        bar.update(task, completed=p.step, info=info)
        if not err.is_terminal and (p.checkpointed or time.monotonic() - last_log[0] > 60):
            last_log[0] = time.monotonic()
            rate = p.tokens / max(p.elapsed, 1e-9)
            err.print(f"step {p.step}/{p.total_steps} epoch {p.epoch} {info} {p.elapsed:.0f}s {rate:.0f} tok/s")

    return bar, on_start, on_step
