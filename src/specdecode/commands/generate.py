"""`specdecode generate`: one prompt, decoded speculatively (or plainly), printed with a stats line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from specdecode.commands import (
    TARGET_HELP,
    DtypeOption,
    GroupSizeOption,
    HeadOption,
    HeadsOption,
    MaxContextOption,
    ProposerChoice,
    QuantizationOption,
    SuffixCacheOption,
    TreeNodesOption,
    err,
    parse_gamma,
    parse_quantization,
    quiet_transformers,
)
from specdecode.commands.grammar_options import JsonSchemaOption, RegexOption, grammar_option

if TYPE_CHECKING:
    from specdecode import GenerationOutput


def generate(
    prompt: str = typer.Argument(..., help="The prompt text ('-' reads it from standard input)."),
    target: str = typer.Option("smollm2", help=TARGET_HELP),
    draft: str | None = typer.Option(
        None,
        help="Draft model (HF folder or .gguf), self:N for the target's first N layers, or skip:SKIP.json "
        "(from tune-skip) / skip:3,5,9-12 for the target without those layers.",
    ),
    proposer: ProposerChoice | None = typer.Option(
        None,
        help="Where guesses come from: draft (needs --draft), "
        "lookup (prompt lookup), eagle (a trained draft head), medusa (trained Medusa heads), suffix (earlier "
        "answers too, with --suffix-cache), eagle+lookup / eagle+suffix (copy where the text repeats, else the head "
        "guesses) or none (plain decoding). Default: draft with --draft, eagle with --head, medusa with --heads, "
        "else lookup (the fastest here over repeated runs; eagle+lookup is level greedy and behind sampled).",
    ),
    gamma: str = typer.Option(
        "auto", help="Tokens guessed per round, or auto (adapts each round to the measured costs, 0 = plain)."
    ),
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
    show: bool = typer.Option(
        False,
        "--show",
        help="Print the answer coloured by how each token was made: a guess the target accepted (green, by depth "
        "in its round) or the target's own token (after a rejection, a bonus, or a plain step), with a legend.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, ids, seed, stats)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    verbose: bool = typer.Option(
        False, "--verbose", help="Say which runner and weight formats the model got (and why, on a fallback)."
    ),
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
    max_context: MaxContextOption = None,
    head: HeadOption = None,
    tree_nodes: TreeNodesOption = None,
    heads: HeadsOption = None,
    suffix_cache: SuffixCacheOption = None,
    json_schema: JsonSchemaOption = None,
    regex: RegexOption = None,
) -> None:
    """Generate text from PROMPT with speculative decoding and print it with a stats line."""
    from specdecode import SamplingParams, SpeculativeDecoder, autoregressive_generate
    from specdecode.commands import build_proposer, load
    from specdecode.models.loader import resolve_dtype

    if show and (stream or as_json):
        raise ValueError("--show prints the coloured answer once it is complete: drop --stream and --json")
    if prompt == "-":
        prompt = sys.stdin.read()
    history_file = None if suffix_cache is None else Path(suffix_cache).expanduser()
    if history_file is not None and not history_file.parent.is_dir():
        raise FileNotFoundError(f"--suffix-cache: the folder {history_file.parent} does not exist")
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        stop=tuple(stop),
        grammar=grammar_option(json_schema, regex),
    )
    if dtype != "auto":
        resolve_dtype(dtype)
    parse_quantization(quantization)  # validate before the slow load
    choice = proposer or default_proposer(draft, head, heads)
    if choice is ProposerChoice.draft and not draft:
        raise ValueError("--proposer draft needs --draft PATH, self:N or skip:SKIP.json")
    quiet_transformers()
    with err.status(f"loading {target}…"):
        target_model = load(target, dtype, quantization, group_size, max_context)
        chosen = (
            None
            if choice is ProposerChoice.none
            else build_proposer(
                choice.value,
                target_model,
                draft,
                dtype,
                quantization,
                group_size,
                head=head,
                tree_nodes=tree_nodes,
                heads=heads,
                suffix_cache=suffix_cache,
            )
        )
    if verbose:
        err.print(f"[dim]{target_model.describe()}[/dim]", highlight=False, soft_wrap=True)
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
                    "proposer": choice.value,
                    "sources": [{"kind": s.kind, "depth": s.depth} for s in out.sources],
                    "stats": out.stats.to_dict(),
                }
            )
        )
    elif show:
        from rich.console import Console

        from specdecode.commands.show import coloured, legend
        from specdecode.provenance import token_pieces

        console = Console(highlight=False, soft_wrap=True)
        console.print(coloured(token_pieces(target_model.decode, out.token_ids, out.text), out.sources))
        err.print(legend(out.sources), highlight=False, soft_wrap=True)
        err.print(f"[dim]{stats_line(out, choice)}[/dim]", highlight=False)
    else:
        print("" if stream else out.text)
        err.print(f"[dim]{stats_line(out, choice)}[/dim]", highlight=False)
    if history_file is not None and chosen is not None:
        chosen.save(history_file)  # the history, now with this prompt and answer (after the output is out)


def default_proposer(draft: str | None, head: str | None, heads: str | None) -> ProposerChoice:
    """The proposer when ``--proposer`` is not given: the one the other options name (``--draft``, ``--head``,
    ``--heads``), else prompt lookup (the fastest over repeated runs here: docs/BENCHMARKS.md)."""
    if draft:
        return ProposerChoice.draft
    if head is not None:
        return ProposerChoice.eagle
    if heads is not None:
        return ProposerChoice.medusa
    return ProposerChoice.lookup


def stats_line(out: GenerationOutput, choice: ProposerChoice) -> str:
    """The line printed after the answer: the run's figures, the proposer, the seed and why it stopped."""
    return f"{out.stats.summary()}; proposer {choice.value}; seed {out.seed}; finish: {out.finish_reason}"
