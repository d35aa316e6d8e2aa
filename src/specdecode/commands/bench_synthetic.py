"""`specdecode bench --synthetic`: what models of real sizes cost to load and run, on GGUF files of random weights
in their exact shapes (``bench.synthetic``), ours next to llama.cpp's (``bench.load_cost``)."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdecode.bench.session import BenchSettings
from specdecode.commands import usage_errors

SUMMARY_COLUMNS = ("load_s", "peak_rss_mb", "disk_written_mb", "prefill_500_s", "step_ms")


def synthetic_shapes(options: BenchSettings) -> list[str]:
    """--synthetic's shapes, refused with the options it takes no part of."""
    from specdecode.bench.synthetic import parse_shapes

    shapes = parse_shapes(options.synthetic)
    taken = {
        "--target": options.target != "smollm2",
        "--prompts": options.prompts is not None,
        "--draft": options.draft is not None,
        "--verify-curve": options.verify_curve,
    }
    given = [name for name, value in taken.items() if value]
    if given:
        raise ValueError(f"--synthetic measures its own files: it takes no {given[0]}")
    if options.threads is not None and options.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {options.threads}")
    return shapes


def bench_synthetic(
    shapes: list[str],
    rounds: int,
    threads: int | None,
    llamacpp: bool,
    llamacpp_python: str | None,
    out: Path,
    console: Console,
) -> None:
    """``bench --synthetic``: write each shape's file (once, into the cache), then ``compare_load`` on it; one JSON
    line per measurement into OUT/synthetic.jsonl and a table of medians."""
    import importlib.util
    import sys

    import torch
    from rich.table import Table

    from specdecode.bench.llamacpp import INSTALL_HINT

    threads = threads or torch.get_num_threads()
    if llamacpp_python is None and llamacpp:
        if importlib.util.find_spec("llama_cpp") is None:
            console.print(f"[yellow]note:[/] llama.cpp skipped: {INSTALL_HINT}", soft_wrap=True)
        else:
            llamacpp_python = sys.executable
    with usage_errors():
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create --out folder {out}: {e.strerror or e}") from None
    console.print("random weights in real shapes: load, memory and speed only (acceptance cannot be measured on them)")
    table = Table("shape", "file", "engine, load", "load s", "peak RSS MB", "disk MB", "prefill 500 s", "step ms")
    table.add_column("v(2/4/8)")
    written = out / "synthetic.jsonl"
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with written.open("w") as log, Progress(*columns, console=console) as progress:
        for name in shapes:
            for row in _measure_shape(name, rounds, threads, llamacpp_python, log, progress):
                table.add_row(*row)
    screen = Console()
    natural = screen.measure(table, options=screen.options.update_width(1000)).maximum
    Console(width=max(screen.width, natural)).print(table)  # never squeeze columns
    console.print(f"medians over {rounds} rounds, {threads} threads; every measurement in {written}")


def _measure_shape(
    name: str, rounds: int, threads: int, llamacpp_python: str | None, log: TextIO, progress: Progress
) -> list[list[str]]:
    """Write shape ``name``'s file if the cache lacks it, measure it (each result a JSON line in ``log``), and
    return the table's rows: the medians per engine and load."""
    import json

    from specdecode.bench.load_cost import compare_load, measurements, medians
    from specdecode.bench.synthetic import SHAPES, synthetic_gguf, synthetic_path

    shape = SHAPES[name]
    if synthetic_path(name).is_file():
        path, _ = synthetic_gguf(name)
    else:
        task = progress.add_task(f"{name}: writing {synthetic_path(name).name} (MiB)", total=None)
        path, _ = synthetic_gguf(
            name, lambda done, total: progress.update(task, completed=done >> 20, total=total >> 20)
        )
        progress.update(task, description=f"{name}: written, {path.stat().st_size / 1e9:.2f} GB")
    task = progress.add_task(f"{name}: loading and stepping", total=measurements(llamacpp_python is not None, rounds))

    def logged(engine: str, row: dict) -> None:
        log.write(json.dumps({"shape": name, "model": shape.model, "file": str(path), "engine_load": engine, **row}))
        log.write("\n")
        log.flush()
        progress.advance(task)

    rows = []
    for engine, found in compare_load(path, rounds, threads, llamacpp_python, logged).items():
        figures = medians(found)
        cells = [f"{figures[k]:.2f}" if k in figures else "-" for k in SUMMARY_COLUMNS]
        v = "/".join(f"{figures[f'v{k}']:.2f}" for k in "248") if "v2" in figures else "-"
        rows.append([f"{name} ({shape.model})", f"{path.stat().st_size / 1e9:.2f} GB", engine, *cells, v])
    return rows
