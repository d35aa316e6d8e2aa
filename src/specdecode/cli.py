"""The ``specdecode`` command: generate, demo, and the commands of commands/."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from enum import Enum
from typing import Any

import typer
from rich.console import Console

from .commands.bench import bench
from .commands.check_exact import check_exact
from .commands.plan import plan
from .commands.quality import quality
from .errors import SpecDecodeError

app = typer.Typer(
    help="Speculative decoding that makes generation faster without changing its output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
USER_ERRORS = (SpecDecodeError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError)


def friendly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a user mistake into one red line on stderr and exit code 1, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None

    return wrapper


class ProposerChoice(str, Enum):
    draft = "draft"
    lookup = "lookup"
    none = "none"


def quiet_transformers() -> None:
    """Silence transformers' info/warning chatter on the terminal (errors still show)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


@app.command()
@friendly
def generate(
    prompt: str = typer.Argument(..., help="The prompt text ('-' reads it from standard input)."),
    target: str = typer.Option(
        "smollm2", help="Target model: a bundled name (smollm2, gemma3-270m), an HF folder or a .gguf file."
    ),
    draft: str | None = typer.Option(
        None,
        help="Draft model (HF folder or .gguf), or self:N for the target's "
        "first N layers (a stand-in for models with no small sibling).",
    ),
    proposer: ProposerChoice | None = typer.Option(
        None,
        help="Where guesses come from: draft (needs --draft), "
        "lookup (prompt lookup) or none (plain decoding). Default: "
        "draft if --draft is given, else lookup.",
    ),
    gamma: str = typer.Option("4", help="Tokens guessed per round, or auto (adapts each round, 0 = plain)."),
    mode: str = typer.Option(
        "exact", help="exact (min(1, p/q) rule) or reproducible (the same text as --proposer none, same seed)."
    ),
    temperature: float = typer.Option(0.0, help="0 = greedy (identical to plain decoding)."),
    top_k: int = typer.Option(0, help="Keep the k most probable tokens (0 = off)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass in (0, 1] (1 = off)."),
    seed: int | None = typer.Option(None, help="Random seed (default: fresh, printed so the run can be replayed)."),
    max_new_tokens: int = typer.Option(128, help="Most tokens to generate."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable); it is cut from the output."),
    stream: bool = typer.Option(False, "--stream", help="Print text as tokens are accepted."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, ids, seed, stats)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    dtype: str = typer.Option("float32", help="Dense weights' dtype: float32 or bfloat16 (with --quantization none)."),
    quantization: str = typer.Option(
        "auto",
        help="Weights: auto (a GGUF file's own 4-bit blocks where the native runner runs it, else dense), "
        "gguf, int8, int4 (groups of --group-size) or none (dense in --dtype: the float32 reference).",
    ),
    group_size: int = typer.Option(32, help="int4: weights per quantization group (32, 64, 128 or 256)."),
) -> None:
    """Generate text from PROMPT with speculative decoding and print it with a stats line."""
    from . import SamplingParams, SpeculativeDecoder, autoregressive_generate
    from .models.loader import resolve_dtype

    if prompt == "-":
        prompt = sys.stdin.read()
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        stop=tuple(stop),
    )
    resolve_dtype(dtype)
    parse_quantization(quantization)  # validate before the slow load
    choice = proposer or (ProposerChoice.draft if draft else ProposerChoice.lookup)
    if choice is ProposerChoice.draft and not draft:
        raise ValueError("--proposer draft needs --draft PATH or --draft self:N")
    quiet_transformers()
    with err.status(f"loading {target}…"):
        target_model = _load(target, dtype, quantization, group_size)
        chosen = (
            None
            if choice is ProposerChoice.none
            else build_proposer(choice.value, target_model, draft, dtype, quantization, group_size)
        )
    ids = target_model.encode(prompt) if raw else target_model.chat_prompt(prompt)
    on_text = None
    if stream and not as_json:

        def on_text(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

    if chosen is None:
        out = autoregressive_generate(target_model, ids, params, on_text=on_text)
    else:
        decoder = SpeculativeDecoder(target_model, chosen, gamma=parse_gamma(gamma), mode=mode)
        out = decoder.generate(ids, params, on_text=on_text)
    if as_json:
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "seed": out.seed,
                    "finish_reason": out.finish_reason,
                    "stats": out.stats.to_dict(),
                }
            )
        )
        return
    if stream:
        print()
    else:
        print(out.text)
    err.print(f"[dim]{out.stats.summary()}; seed {out.seed}; finish: {out.finish_reason}[/dim]", highlight=False)


def parse_gamma(text: str) -> int | str:
    """``auto`` or a positive integer, from the command line."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--gamma must be an integer >= 1 or auto, got {text!r}")
    return int(text)


def parse_quantization(text: str) -> str | None:
    """``--quantization`` words: ``none`` = dense, else auto / gguf / int8 / int4."""
    from .models.quantize import QUANTIZATIONS

    if text == "none":
        return None
    if text not in ("auto", *QUANTIZATIONS):
        raise ValueError(f"--quantization must be auto, {', '.join(QUANTIZATIONS)} or none, got {text!r}")
    return text


def _load(name: str, dtype: str, quantization: str = "auto", group_size: int = 32):
    from .models.loader import load_model

    return load_model(name, dtype=dtype, quantization=parse_quantization(quantization), group_size=group_size)


def build_proposer(
    kind: str, target, draft: str | None, dtype: str = "float32", quantization: str = "auto", group_size: int = 32
):
    """A proposer from CLI words: ``lookup``, or ``draft`` with a path or ``self:N``."""
    from .proposers import DraftModelProposer, LayerSkipProposer, PromptLookupProposer

    if kind == "lookup":
        return PromptLookupProposer()
    if kind != "draft":
        raise ValueError(f"unknown proposer {kind!r}: use draft, lookup or none")
    if draft is None:
        raise ValueError("the draft proposer needs --draft PATH or --draft self:N")
    if draft.startswith("self:"):
        layers = draft.removeprefix("self:")
        if not layers.isdigit():
            raise ValueError(f"--draft self:N needs an integer layer count, got {draft!r}")
        return LayerSkipProposer(target, int(layers))
    return DraftModelProposer(_load(draft, dtype, quantization, group_size))


@app.command()
@friendly
def demo(
    target: str = typer.Option("smollm2", help="Target model (bundled name, HF folder or .gguf)."),
    gamma: str = typer.Option(
        "auto", help="Tokens guessed per round by prompt lookup, or auto (adapts to the measured verify cost)."
    ),
    max_new_tokens: int = typer.Option(160, help="Tokens to generate in each run."),
    dtype: str = typer.Option("float32", help="Dense weights' dtype: float32 or bfloat16 (with --quantization none)."),
    quantization: str = typer.Option(
        "auto",
        help="Weights: auto (a GGUF file's own 4-bit blocks where the native runner runs it, else dense), "
        "gguf, int8, int4 (groups of --group-size) or none (dense in --dtype: the float32 reference).",
    ),
    group_size: int = typer.Option(32, help="int4: weights per quantization group (32, 64, 128 or 256)."),
) -> None:
    """Edit a pasted passage plainly and speculatively; show the outputs match and the measured speedup."""
    from .demo import run_demo

    quiet_transformers()
    run_demo(target, parse_gamma(gamma), max_new_tokens, dtype, Console(), quantization, group_size)


for _name, _command in (("plan", plan), ("bench", bench), ("check-exact", check_exact), ("quality", quality)):
    app.command(_name)(friendly(_command))


def main() -> None:
    """Entry point of the ``specdecode`` script."""
    quiet_transformers()
    app()
