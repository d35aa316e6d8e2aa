"""`specdecode check-exact`: sample the first tokens speculatively many times and test them against the target."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from specdecode.commands import (
    DraftOption,
    DtypeOption,
    GroupSizeOption,
    HeadOption,
    HeadsOption,
    QuantizationOption,
    TreeNodesOption,
)

DEFAULT_PROMPTS = (
    "Write one sentence about the sea.",
    "List three colours.",
    "What is the capital of France?",
)


class Mode(str, Enum):
    exact = "exact"
    reproducible = "reproducible"


ProposerOption = Annotated[
    str | None,
    typer.Option(
        help="draft (needs --draft), lookup, eagle, medusa, suffix, eagle+suffix or eagle+lookup; default: draft "
        "if --draft is given."
    ),
]
TreeWidthOption = Annotated[
    int, typer.Option(min=1, help="lookup: offer up to this many distinct matches as a token tree (1 = chain).")
]
PromptsOption = Annotated[
    Path | None,
    typer.Option(help="FastChat JSONL (question_id, category, turns); turns[0] is used. Default: built-in."),
]
ModeOption = Annotated[Mode, typer.Option(help="exact (min(1, p/q) rule) or reproducible (seed-identical).")]


def check_exact(
    target: Annotated[str, typer.Option(help="Target model: a bundled name, HF folder or .gguf.")] = "smollm2",
    draft: DraftOption = None,
    proposer: ProposerOption = None,
    gamma: Annotated[int, typer.Option(min=1, help="Tokens guessed per round (a token tree's depth).")] = 4,
    tree_width: TreeWidthOption = 1,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most probable tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass in (0, 1] (1 = off).")] = 1.0,
    prompts: PromptsOption = None,
    samples: Annotated[int, typer.Option(min=1, help="Speculative samples per prompt.")] = 1000,
    mode: ModeOption = Mode.exact,
    alpha: Annotated[float, typer.Option(help="Family false-alarm rate (Bonferroni over prompts × K).")] = 0.01,
    cap: Annotated[int, typer.Option(min=1, help="K=2: first tokens enumerated exactly; the rest pooled.")] = 64,
    seed: Annotated[int, typer.Option(min=0, help="Sample i uses seed + i.")] = 0,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
    head: HeadOption = None,
    tree_nodes: TreeNodesOption = None,
    heads: HeadsOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Test that speculative decoding samples the first 1 and 2 tokens exactly as the target does."""
    from specdecode.bench.workloads import load_items
    from specdecode.commands import build_proposer, load, quiet_transformers
    from specdecode.exactness.check import check_exactness
    from specdecode.sampling.params import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    kind = proposer or ("draft" if draft else "lookup")
    texts = list(DEFAULT_PROMPTS) if prompts is None else [item.turns[0] for item in load_items(prompts)]
    err = Console(stderr=True)
    quiet_transformers()
    with err.status(f"loading {target}…"):
        target_model = load(target, dtype, quantization, group_size)
        chosen = build_proposer(
            kind,
            target_model,
            draft,
            dtype,
            quantization,
            group_size,
            head=head,
            tree_nodes=tree_nodes,
            tree_width=tree_width,
            heads=heads,
        )
    prompt_ids = [
        text if isinstance(text, list) else target_model.encode(text) if raw else target_model.chat_prompt(text)
        for text in texts
    ]
    columns = (TextColumn("sampling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("sampling", total=len(prompt_ids) * samples)
        report = check_exactness(
            target_model,
            chosen,
            prompt_ids,
            params,
            samples=samples,
            gamma=gamma,
            mode=mode.value,
            alpha=alpha,
            cap=cap,
            seed=seed,
            on_sample=lambda: progress.advance(task),
        )
    if as_json:
        settings = {"target": target, "proposer": draft or kind, "tree_width": tree_width, "mode": mode.value}
        print(json.dumps({**settings, **report.to_dict()}))
    else:
        _print_report(report, texts, Console())
    if not report.passed:
        raise typer.Exit(1)


def _print_report(report, texts: list, console: Console) -> None:
    table = Table("K", "cells", "χ²", "df", "p", "TV", "TV if exact", "TV ≤", "verdict")
    table.add_column("prompt", no_wrap=True, overflow="ellipsis", max_width=32)
    for test in report.tests:
        verdict = "[red]biased[/red]" if test.rejected else "[green]ok[/green]"
        table.add_row(
            str(test.k),
            str(test.cells),
            f"{test.statistic:.1f}",
            str(test.dof),
            f"{test.p_value:.3g}",
            f"{test.tv:.3f}",
            f"{test.tv_null:.3f}",
            f"{test.tv_upper:.3f}",
            verdict,
            str(texts[test.prompt_index]),
        )
    console.print(table)
    rate = report.accepted / report.drafted if report.drafted else 0.0
    console.print(
        f"acceptance {rate:.2f} ({report.accepted}/{report.drafted}); per-test threshold {report.threshold:.2g}"
    )
    console.print(("[green]" if report.passed else "[red]") + report.verdict, highlight=False)
