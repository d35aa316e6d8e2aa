"""`specdecode generate`: one prompt, decoded speculatively (or plainly), printed with a stats line."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specdecode.commands import (
    TARGET_HELP,
    DraftOption,
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
    from specdecode import GenerationOutput, SamplingParams


PromptArgument = Annotated[str, typer.Argument(help="The prompt text ('-' reads it from standard input).")]
ProposerOption = Annotated[
    ProposerChoice | None,
    typer.Option(
        help="Where guesses come from: draft (needs --draft), "
        "lookup (prompt lookup), eagle (a trained draft head), medusa (trained Medusa heads), suffix (earlier "
        "answers too, with --suffix-cache), eagle+lookup / eagle+suffix (copy where the text repeats, else the head "
        "guesses) or none (plain decoding). Default: draft with --draft, eagle with --head, medusa with --heads, "
        "else lookup (the fastest here over repeated runs; eagle+lookup is level greedy and behind sampled).",
    ),
]
GammaOption = Annotated[
    str, typer.Option(help="Tokens guessed per round, or auto (adapts each round to the measured costs, 0 = plain).")
]
ModeOption = Annotated[
    str, typer.Option(help="exact (min(1, p/q) rule) or reproducible (the same text as --proposer none, same seed).")
]
ShowOption = Annotated[
    bool,
    typer.Option(
        "--show",
        help="Print the answer coloured by how each token was made: a guess the target accepted (green, by depth "
        "in its round) or the target's own token (after a rejection, a bonus, or a plain step), with a legend.",
    ),
]
VerboseOption = Annotated[
    bool,
    typer.Option("--verbose", help="Say which runner and weight formats the model got (and why, on a fallback)."),
]


def generate(
    prompt: PromptArgument,
    target: Annotated[str, typer.Option(help=TARGET_HELP)] = "smollm2",
    draft: DraftOption = None,
    proposer: ProposerOption = None,
    gamma: GammaOption = "auto",
    mode: ModeOption = "exact",
    temperature: Annotated[float, typer.Option(help="0 = greedy (identical to plain decoding).")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most probable tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1] (1 = off).")] = 1.0,
    seed: Annotated[
        int | None, typer.Option(help="Random seed (default: fresh, printed so the run can be replayed).")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    stop: list[str] = typer.Option([], help="Stop string (repeatable); it is cut from the output."),
    stream: Annotated[bool, typer.Option("--stream", help="Print text as tokens are accepted.")] = False,
    show: ShowOption = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, ids, seed, stats).")] = False,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    verbose: VerboseOption = False,
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
    options = GenerateOptions(**locals())  # every parameter, as typer parsed it (nothing else is bound yet)
    from specdecode import SpeculativeDecoder, autoregressive_generate
    from specdecode.commands import load

    checked = _checked(options)
    params, choice = checked.params, checked.choice
    quiet_transformers()
    with err.status(f"loading {target}…"):
        target_model = load(target, dtype, quantization, group_size, max_context)
        chosen = None if choice is ProposerChoice.none else _proposer(options, choice, target_model)
    if verbose:
        err.print(f"[dim]{target_model.describe()}[/dim]", highlight=False, soft_wrap=True)
    ids = target_model.encode(checked.prompt) if raw else target_model.chat_prompt(checked.prompt)
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
    _printed(options, out, choice, target_model)
    if checked.history_file is not None and chosen is not None:
        chosen.save(checked.history_file)  # the history, now with this prompt and answer (after the output is out)


@dataclass(frozen=True)
class GenerateOptions:
    """``generate``'s options as given (see its parameters' help)."""

    prompt: str
    target: str
    draft: str | None
    proposer: ProposerChoice | None
    gamma: str
    mode: str
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    max_new_tokens: int
    stop: list[str]
    stream: bool
    show: bool
    as_json: bool
    raw: bool
    verbose: bool
    dtype: str
    quantization: str
    group_size: int
    max_context: int | None
    head: str | None
    tree_nodes: int | None
    heads: str | None
    suffix_cache: str | None
    json_schema: str | None
    regex: str | None


@dataclass(frozen=True)
class _Checked:
    """What ``generate`` runs, every option checked before the slow load."""

    prompt: str  # the prompt's text (read from standard input for '-')
    params: SamplingParams
    history_file: Path | None  # --suffix-cache
    choice: ProposerChoice


def _checked(options: GenerateOptions) -> _Checked:
    """The prompt, the sampling settings, the --suffix-cache file and the proposer chosen, each option checked (in
    one line on a mistake) before the slow load."""
    from specdecode import SamplingParams
    from specdecode.models.loaded import resolve_dtype

    if options.show and (options.stream or options.as_json):
        raise ValueError("--show prints the coloured answer once it is complete: drop --stream and --json")
    prompt = sys.stdin.read() if options.prompt == "-" else options.prompt
    history_file = None if options.suffix_cache is None else Path(options.suffix_cache).expanduser()
    if history_file is not None and not history_file.parent.is_dir():
        raise FileNotFoundError(f"--suffix-cache: the folder {history_file.parent} does not exist")
    params = SamplingParams(
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        max_new_tokens=options.max_new_tokens,
        seed=options.seed,
        stop=tuple(options.stop),
        grammar=grammar_option(options.json_schema, options.regex),
    )
    if options.dtype != "auto":
        resolve_dtype(options.dtype)
    parse_quantization(options.quantization)  # validate before the slow load
    choice = options.proposer or default_proposer(options.draft, options.head, options.heads)
    if choice is ProposerChoice.draft and not options.draft:
        raise ValueError("--proposer draft needs --draft PATH, self:N or skip:SKIP.json")
    return _Checked(prompt, params, history_file, choice)


def _proposer(options: GenerateOptions, choice: ProposerChoice, target_model: Any) -> Any:
    """The proposer ``choice`` names, built over ``target_model`` with the options that concern it."""
    from specdecode.commands import build_proposer

    return build_proposer(
        choice.value,
        target_model,
        options.draft,
        options.dtype,
        options.quantization,
        options.group_size,
        head=options.head,
        tree_nodes=options.tree_nodes,
        heads=options.heads,
        suffix_cache=options.suffix_cache,
    )


def _printed(options: GenerateOptions, out: GenerationOutput, choice: ProposerChoice, target_model: Any) -> None:
    """The answer on stdout (plain, one JSON object with --json, or coloured with --show), the stats on stderr."""
    if options.as_json:
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
    elif options.show:
        from rich.console import Console

        from specdecode.commands.show import coloured, legend
        from specdecode.engine.provenance import token_pieces

        console = Console(highlight=False, soft_wrap=True)
        console.print(coloured(token_pieces(target_model.decode, out.token_ids, out.text), out.sources))
        err.print(legend(out.sources), highlight=False, soft_wrap=True)
        err.print(f"[dim]{stats_line(out, choice)}[/dim]", highlight=False)
    else:
        print("" if options.stream else out.text)
        err.print(f"[dim]{stats_line(out, choice)}[/dim]", highlight=False)


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
