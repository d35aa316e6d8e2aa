"""CLI commands that live in their own modules (registered by ``specdecode.cli``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer


@contextmanager
def usage_errors() -> Iterator[None]:
    """Report a ValueError as one line on stderr and exit code 2 (a usage error), never a traceback."""
    try:
        yield
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
