"""`specdecode generate`: one prompt, decoded speculatively (or plainly), printed with a stats line."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from specdecode import factory
from specdecode.commands import err, quiet_transformers
from specdecode.commands.options import (
    DraftOption,
    DtypeOption,
    GammaOption,
    GroupSizeOption,
    HeadOption,
    HeadsOption,
    JsonSchemaOption,
    MaxContextOption,
    MaxNewTokensOption,
    ModeOption,
    ProposerChoice,
    ProposerOption,
    QuantizationOption,
    RawOption,
    RegexOption,
    SeedOption,
    ShowOption,
    SuffixCacheOption,
    TargetOption,
    TemperatureOption,
    TopKOption,
    TopPOption,
    TreeNodesOption,
    grammar_option,
    parse_gamma,
)

if TYPE_CHECKING:
    from specdecode import GenerationOutput, SamplingParams


PromptArgument = Annotated[str, typer.Argument(help="The prompt text ('-' reads it from standard input).")]
StopOption = Annotated[list[str] | None, typer.Option(help="Stop string (repeatable); it is cut from the output.")]
StreamOption = Annotated[bool, typer.Option("--stream", help="Print text as tokens are accepted.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object (text, ids, seed, stats).")]
VerboseOption = Annotated[
    bool,
    typer.Option("--verbose", help="Say which runner and weight formats the model got (and why, on a fallback)."),
]


def generate(
    prompt: PromptArgument,
    target: TargetOption = "smollm2",
    draft: DraftOption = None,
    proposer: ProposerOption = None,
    gamma: GammaOption = "auto",
    mode: ModeOption = "exact",
    temperature: TemperatureOption = 0.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    seed: SeedOption = None,
    max_new_tokens: MaxNewTokensOption = 128,
    stop: StopOption = None,
    stream: StreamOption = False,
    show: ShowOption = False,
    as_json: JsonOption = False,
    raw: RawOption = False,
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

    checked = _checked(options)
    params, choice = checked.params, checked.choice
    quiet_transformers()
    with err.status(f"loading {target}…"):
        target_model = factory.load(target, dtype, quantization, group_size, max_context)
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
    stop: list[str] | None
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
        stop=tuple(options.stop or ()),
        grammar=grammar_option(options.json_schema, options.regex),
    )
    if options.dtype != "auto":
        resolve_dtype(options.dtype)
    factory.parse_quantization(options.quantization)  # validate before the slow load
    choice = options.proposer or default_proposer(options.draft, options.head, options.heads)
    if choice is ProposerChoice.draft and not options.draft:
        raise ValueError("--proposer draft needs --draft PATH, self:N or skip:SKIP.json")
    return _Checked(prompt, params, history_file, choice)


def _proposer(options: GenerateOptions, choice: ProposerChoice, target_model: Any) -> Any:
    """The proposer ``choice`` names, built over ``target_model`` with the options that concern it."""
    return factory.build_proposer(
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
