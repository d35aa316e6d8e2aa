"""The CLI's commands, one module each (registered by ``specdecode.cli``), and the helpers they share."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from enum import Enum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from specdecode.errors import SpecDecodeError

err = Console(stderr=True)
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
    suffix = "suffix"
    none = "none"


def quiet_transformers() -> None:
    """Silence transformers' info/warning chatter on the terminal (errors still show)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


# The weight options of the commands that load a target (generate, demo, check-exact), worded once.
DtypeOption = Annotated[str, typer.Option(help="Dense weights' dtype: float32 or bfloat16 (with --quantization none).")]
QuantizationOption = Annotated[
    str,
    typer.Option(
        help="Weights: auto (a GGUF file's own blocks where the native runner runs it, else dense), gguf, "
        "gguf-a8 (the same blocks with int8 activations: llama.cpp's numerics, flatter verify cost, a little less "
        "exact), int8, int4 (groups of --group-size) or none (dense in --dtype: the float32 reference)."
    ),
]
GroupSizeOption = Annotated[int, typer.Option(help="int4: weights per quantization group (32, 64, 128 or 256).")]
# The EAGLE proposer's options, worded once.
HeadOption = Annotated[
    str | None,
    typer.Option(help="--proposer eagle: a head trained with train-head (default: the one shipped for the target)."),
]
TreeNodesOption = Annotated[
    int | None,
    typer.Option(help="--proposer eagle or suffix: nodes of the token tree, 0 = a chain (default: the proposer's)."),
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


def parse_quantization(text: str) -> str | None:
    """``--quantization`` words: ``none`` = dense, else auto / gguf / int8 / int4."""
    from specdecode.models.quantize import QUANTIZATIONS

    if text == "none":
        return None
    if text not in ("auto", *QUANTIZATIONS):
        raise ValueError(f"--quantization must be auto, {', '.join(QUANTIZATIONS)} or none, got {text!r}")
    return text


def load(name: str, dtype: str, quantization: str = "auto", group_size: int = 32):
    """A model from CLI words (``--quantization`` as the CLI spells it)."""
    from specdecode.models.loader import load_model

    return load_model(name, dtype=dtype, quantization=parse_quantization(quantization), group_size=group_size)


def build_proposer(
    kind: str,
    target,
    draft: str | None,
    dtype: str = "float32",
    quantization: str = "auto",
    group_size: int = 32,
    head: str | None = None,
    tree_nodes: int | None = None,
    tree_width: int = 1,
    suffix_cache: str | None = None,
):
    """A proposer from CLI words: ``lookup``, ``eagle`` (with a head folder or the shipped head; ``tree_nodes``
    0 = a chain), ``suffix`` (over the history in ``suffix_cache`` if that file exists), or ``draft`` with a
    path or ``self:N``; ``tree_width`` > 1: lookup offers that many distinct matches as a token tree."""
    from specdecode.proposers import DraftModelProposer, EagleProposer, LayerSkipProposer, PromptLookupProposer

    if tree_width < 1:
        raise ValueError(f"--tree-width must be >= 1, got {tree_width}")
    if suffix_cache is not None and kind != "suffix":
        raise ValueError(f"--suffix-cache applies to the suffix proposer, not {kind}")
    if tree_width > 1 and kind != "lookup":
        raise ValueError(f"--tree-width applies to the lookup proposer, not {kind}")
    if kind == "lookup":
        return PromptLookupProposer(branches=tree_width)
    if kind == "eagle":
        if tree_nodes is not None and tree_nodes < 0:
            raise ValueError(f"--tree-nodes must be >= 0 (0 = a chain), got {tree_nodes}")
        shape = {} if tree_nodes is None else {"tree_nodes": tree_nodes or None}
        return EagleProposer(target, head=head, **shape)
    if kind == "suffix":
        return suffix_proposer(suffix_cache, tree_nodes)
    if kind != "draft":
        raise ValueError(f"unknown proposer {kind!r}: use draft, lookup, eagle, suffix or none")
    if draft is None:
        raise ValueError("the draft proposer needs --draft PATH or --draft self:N")
    if draft.startswith("self:"):
        layers = draft.removeprefix("self:")
        if not layers.isdigit():
            raise ValueError(f"--draft self:N needs an integer layer count, got {draft!r}")
        return LayerSkipProposer(target, int(layers))
    return DraftModelProposer(load(draft, dtype, quantization, group_size))


def suffix_proposer(cache: str | None, tree_nodes: int | None = None, remember: bool = True):
    """A SuffixProposer over the history file ``cache`` (loaded if it exists; a new history otherwise)."""
    from pathlib import Path

    from specdecode.proposers import SuffixProposer

    if tree_nodes is not None and tree_nodes < 0:
        raise ValueError(f"--tree-nodes must be >= 0 (0 = a chain), got {tree_nodes}")
    shape = {} if tree_nodes is None else {"tree_nodes": tree_nodes}
    if cache is not None and Path(cache).expanduser().is_dir():
        raise IsADirectoryError(f"--suffix-cache must be a file, got the folder {cache}")
    if cache is not None and Path(cache).expanduser().exists():
        return SuffixProposer.load(Path(cache).expanduser(), remember=remember, **shape)
    return SuffixProposer(remember=remember, **shape)
