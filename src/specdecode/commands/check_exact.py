"""`specdecode check-exact`: sample the first tokens speculatively many times and test them against the target."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from specdecode import factory
from specdecode.commands import quiet_transformers
from specdecode.commands.generate import default_proposer
from specdecode.commands.options import (
    BaseSeedOption,
    DraftOption,
    DtypeOption,
    GroupSizeOption,
    HeadOption,
    HeadsOption,
    ModeOption,
    PromptsOption,
    ProposerOption,
    QuantizationOption,
    RawOption,
    TargetOption,
    TemperatureOption,
    TopKOption,
    TopPOption,
    TreeNodesOption,
)

DEFAULT_PROMPTS = (
    "Write one sentence about the sea.",
    "List three colours.",
    "What is the capital of France?",
)

GammaOption = Annotated[int, typer.Option(min=1, help="Tokens guessed per round (a token tree's depth).")]
TreeWidthOption = Annotated[
    int, typer.Option(min=1, help="lookup: offer up to this many distinct matches as a token tree (1 = chain).")
]
SamplesOption = Annotated[int, typer.Option(min=1, help="Speculative samples per prompt (turns[0] of --prompts).")]
AlphaOption = Annotated[float, typer.Option(help="Family false-alarm rate (Bonferroni over prompts × K).")]
CapOption = Annotated[int, typer.Option(min=1, help="K=2: first tokens enumerated exactly; the rest pooled.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def check_exact(
    target: TargetOption = "smollm2",
    draft: DraftOption = None,
    proposer: ProposerOption = None,
    gamma: GammaOption = 4,
    tree_width: TreeWidthOption = 1,
    temperature: TemperatureOption = 1.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    prompts: PromptsOption = None,
    samples: SamplesOption = 1000,
    mode: ModeOption = "exact",
    alpha: AlphaOption = 0.01,
    cap: CapOption = 64,
    seed: BaseSeedOption = 0,
    raw: RawOption = False,
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
    head: HeadOption = None,
    tree_nodes: TreeNodesOption = None,
    heads: HeadsOption = None,
    as_json: JsonOption = False,
) -> None:
    """Test that speculative decoding samples the first 1 and 2 tokens exactly as the target does."""
    from specdecode.bench.workloads import load_items
    from specdecode.exactness.check import check_exactness
    from specdecode.sampling.params import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    kind = (proposer or default_proposer(draft, head, heads)).value
    texts = list(DEFAULT_PROMPTS) if prompts is None else [item.turns[0] for item in load_items(prompts)]
    err = Console(stderr=True)
    quiet_transformers()
    with err.status(f"loading {target}…"):
        target_model = factory.load(target, dtype, quantization, group_size)
        chosen = factory.build_proposer(
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
            mode=mode,
            alpha=alpha,
            cap=cap,
            seed=seed,
            on_sample=lambda: progress.advance(task),
        )
    if as_json:
        settings = {"target": target, "proposer": draft or kind, "tree_width": tree_width, "mode": mode}
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
