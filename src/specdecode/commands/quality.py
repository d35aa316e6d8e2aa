"""`specdecode quality`: how far each way of storing the weights moves the model from dense float32."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdecode.commands import quiet_transformers, usage_errors
from specdecode.commands.options import GroupSizeOption, TargetOption

QuantizationsOption = Annotated[
    str,
    typer.Option(
        help="Comma list of weight settings to compare with dense float32: gguf, gguf-a8, int8, int4 (or auto, none)."
    ),
]
TextOption = Annotated[
    Path | None, typer.Option(help="UTF-8 text file to read raw (default: the shipped held-out prose).")
]
MaxTokensOption = Annotated[int | None, typer.Option(help="Read at most N tokens of the text.")]
GreedyTokensOption = Annotated[int, typer.Option(help="Length of the float32 model's greedy answers.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def quality(
    target: TargetOption = "smollm2",
    quantization: QuantizationsOption = "gguf,gguf-a8,int8,int4",
    group_size: GroupSizeOption = 32,
    text: TextOption = None,
    max_tokens: MaxTokensOption = None,
    greedy_tokens: GreedyTokensOption = 128,
    json_output: JsonOption = False,
) -> None:
    """Teacher-force held-out text and greedy answers through dense float32 and each quantized setting; report
    top-1 agreement, perplexity, KL(float32 ‖ setting) and the weights' stored bytes."""
    console = Console(stderr=True)
    with usage_errors():
        from specdecode.bench import quality as q
        from specdecode.bench.session import parse_quantizations
        from specdecode.models.formats.weights import GROUP_SIZES

        settings = parse_quantizations(quantization)
        if group_size not in GROUP_SIZES:
            raise ValueError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
        if max_tokens is not None and max_tokens < 2:
            raise ValueError(f"--max-tokens must be >= 2 (one token predicts the next), got {max_tokens}")
        if greedy_tokens < 1:
            raise ValueError(f"--greedy-tokens must be >= 1, got {greedy_tokens}")
        prose = q.held_out_text() if text is None else _read(text)
        quiet_transformers()
        labels = {s: f"int4 (group {group_size})" if s == "int4" else s for s in settings}
        with console.status(f"loading {target}…"):
            reference, models = q.load_settings(target, settings, group_size)
        ids = reference.encode(prose)[:max_tokens]
        if len(ids) < 2:
            raise ValueError(f"the text has {len(ids)} token(s): need at least 2")
        prompts = [reference.chat_prompt(p) for p in q.PROMPTS]
        columns = (TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("teacher forcing", total=q.steps(len(ids), len(settings), len(prompts)))
            report = q.measure_quality(
                reference,
                {labels[s]: models[s] for s in settings},
                ids,
                prompts,
                greedy_tokens=greedy_tokens,
                on_step=lambda what: progress.update(task, advance=1, description=what),
            )
    source = "held-out prose shipped with specdecode" if text is None else str(text)
    if json_output:
        summary = {
            "target": target,
            "text": source,
            "text_tokens": report.text_tokens,
            "chunk": report.chunk,
            "greedy_prompts": len(prompts),
            "greedy_tokens": report.greedy_tokens,
            "reference": dataclasses.asdict(report.reference),
            "settings": [dataclasses.asdict(s) for s in report.settings],
        }
        typer.echo(json.dumps(summary))
        return
    Console().print(_table(report, target, source))


def _read(path: Path) -> str:
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --text {path}: {getattr(e, 'strerror', None) or e}") from None
    if not content.strip():
        raise ValueError(f"--text {path} is empty")
    return content


def _table(report, target: str, source: str) -> Table:
    reference = report.reference
    table = Table(
        title=f"{target}: each weight setting against dense float32",
        caption=f"text: {reference.positions} positions of {source}, raw, read in chunks of {report.chunk} tokens; "
        f"greedy: {reference.greedy_positions} positions of float32's greedy answers; agree = the same argmax "
        "(top-1) as float32; KL(float32 ‖ setting) in nats per text position",
    )
    for name in ("weights", "stored", "agree (text)", "agree (greedy)", "perplexity", "KL"):
        table.add_column(name, justify="left" if name == "weights" else "right")
    for row in (reference, *report.settings):
        is_reference = row is reference
        table.add_row(
            "float32" if is_reference else row.name,
            f"{row.weight_bytes / 2**20:.1f} MiB",
            "–" if is_reference else f"{row.agreement:.2%}",
            "–" if is_reference else f"{row.greedy_agreement:.2%}",
            f"{row.perplexity:.3f}",
            "–" if is_reference else f"{row.kl:.5f}",
        )
    return table
