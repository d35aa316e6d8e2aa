"""The CLI's commands, one module each (registered by ``specdecode.cli``), and the helpers they share: one-line
errors, the progress bar, thread counts. The options they share are ``options``; models and proposers from CLI
words come from ``specdecode.factory``; what a command measures or loads beyond that, from ``specdecode.bench``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from specdecode.errors import SpecDecodeError

err = Console(stderr=True)


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


def quiet_transformers() -> None:
    """Silence transformers' info/warning chatter on the terminal (errors still show)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


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
