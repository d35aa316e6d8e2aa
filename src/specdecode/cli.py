"""The ``specdecode`` command: one typer app over the commands of commands/."""

from __future__ import annotations

import gc
from typing import Annotated

import typer

from .commands import friendly, quiet_transformers
from .commands.bench import bench
from .commands.bench_serve import bench_serve
from .commands.cache import cache_app
from .commands.chat import chat
from .commands.check_exact import check_exact
from .commands.demo import demo
from .commands.generate import generate
from .commands.index import index
from .commands.make_data import make_data
from .commands.plan import plan
from .commands.quality import quality
from .commands.serve import serve
from .commands.train_head import train_head
from .commands.train_medusa import train_medusa
from .commands.tune_skip import tune_skip
from .version import __version__

app = typer.Typer(
    help="Speculative decoding that makes generation faster without changing its output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _name, _command in (
    ("generate", generate),
    ("chat", chat),
    ("demo", demo),
    ("plan", plan),
    ("bench", bench),
    ("check-exact", check_exact),
    ("quality", quality),
    ("serve", serve),
    ("bench-serve", bench_serve),
    ("make-data", make_data),
    ("train-head", train_head),
    ("train-medusa", train_medusa),
    ("tune-skip", tune_skip),
    ("index", index),
):
    app.command(_name)(friendly(_command))
app.add_typer(cache_app, name="cache")


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"specdecode {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Speculative decoding that makes generation faster without changing its output."""


def main() -> None:
    """Entry point of the ``specdecode`` script."""
    quiet_transformers()
    try:
        app()
    finally:
        # The interpreter's garbage collections at exit walk every object a loaded model left (1-3 s after `serve`
        # stopped, measured); frozen objects are skipped, and the operating system frees the memory anyway.
        gc.freeze()
