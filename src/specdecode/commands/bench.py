"""`specdecode bench`: our plain and speculative decoding per weight format vs transformers (and llama.cpp); the run
itself is ``bench.session``'s, this module parses the options and shows the progress and the summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdecode.bench.session import CURVE_MAX_K, BenchSettings
from specdecode.commands import quiet_transformers, usage_errors
from specdecode.commands.options import (
    MAX_CONTEXT_HELP,
    BaseSeedOption,
    CategoriesOption,
    DraftOption,
    LimitOption,
    MaxNewTokensOption,
    PromptsOption,
    TargetOption,
    TemperatureOption,
)

ProposersOption = Annotated[
    str,
    typer.Option(
        help="Comma list of our proposers: lookup, draft (draft needs --draft), eagle, medusa, suffix "
        "(remembers the run's earlier questions and answers, as a server does), eagle+suffix and eagle+lookup "
        "(copy where the text repeats, else the head guesses)."
    ),
]
HeadOption = Annotated[
    str | None, typer.Option(help="eagle: a head trained with train-head (default: the one shipped).")
]
TreeNodesOption = Annotated[
    str | None,
    typer.Option(help="eagle, medusa: comma list of token-tree sizes, one method each (0 = a chain)."),
]
HeadsOption = Annotated[
    str | None, typer.Option(help="medusa: heads trained with train-medusa (default: the ones shipped).")
]
GammasOption = Annotated[
    str, typer.Option(help="Comma list of gammas for each proposer; auto = adaptive (may pick 0).")
]
ModesOption = Annotated[
    str,
    typer.Option(
        help="Comma list of verification modes: exact (min(1, p/q)) and/or reproducible (same text as "
        "plain sampling with the same seed; differs from exact only when --temperature > 0)."
    ),
]
BenchDtypeOption = Annotated[
    str, typer.Option(help="float32 or bfloat16 (bfloat16 needs --quantization none: dense weights).")
]
QuantizationsOption = Annotated[
    str,
    typer.Option(
        help="Comma list of target weight formats, each run with all our methods: auto (a GGUF target's own "
        "blocks, else dense), gguf, gguf-a8, int8, int4, none (dense). With several, method names end in "
        "@setting (ours:plain@gguf) and each is checked against its own plain decode."
    ),
]
HfOption = Annotated[
    bool,
    typer.Option(
        "--hf/--no-hf",
        help="Include transformers' generate (plain, prompt lookup, assisted), always on dense weights.",
    ),
]
LlamacppOption = Annotated[
    bool,
    typer.Option(
        "--llamacpp",
        help="Add llama.cpp's plain and prompt-lookup decoding on the target's GGUF file (needs "
        "llama-cpp-python, not a dependency; greedy only; outputs not expected to equal ours).",
    ),
]
VerifyCurveOption = Annotated[
    bool,
    typer.Option(
        "--verify-curve",
        "--quirk",
        help=f"Measure the verify-cost curve v(k), k = 1..{CURVE_MAX_K} (first --quantization's target; with "
        "--llamacpp, llama.cpp's on the same file too, every row's logits computed, interleaved). "
        "--quirk: deprecated alias.",
    ),
]
CurveRepeatsOption = Annotated[
    int,
    typer.Option(
        "--verify-curve-repeats",
        "--quirk-repeats",
        help="--verify-curve: timed sweeps over k (medians). --quirk-repeats: deprecated alias.",
    ),
]
SyntheticOption = Annotated[
    str | None,
    typer.Option(
        metavar="SHAPES",
        help="Instead of the workloads: what a model of a real size costs to load and run. A comma list of "
        "360m (SmolLM2-360M), 1.7b (SmolLM2-1.7B), 8b (Llama-3.1-8B): each a Q4_K_M-like GGUF of RANDOM weights "
        "in that model's exact shape with the bundled tokenizer (0.27, 1.08, 4.9 GB), written once into "
        "~/.cache/specdecode/synthetic/ ($SPECDECODE_CACHE/synthetic/) and reused; then load time, peak "
        "memory, disk written, prefill, step and v(k), ours next to llama.cpp's with --llamacpp. Random "
        "weights write noise: acceptance, and so speedup, cannot be measured on them.",
    ),
]
RoundsOption = Annotated[
    int, typer.Option(min=1, help="--synthetic: measurement rounds per file (engines alternated; medians).")
]
LlamacppPythonOption = Annotated[
    str | None,
    typer.Option(
        help="--synthetic: an interpreter with llama-cpp-python to run llama.cpp in (implies --llamacpp; "
        "default with --llamacpp: this one)."
    ),
]


ThreadsOption = Annotated[int | None, typer.Option(help="Torch threads, also llama.cpp's (default: torch's choice).")]
WarmupOption = Annotated[int, typer.Option(help="Questions run untimed by every method first.")]
MaxContextOption = Annotated[int | None, typer.Option(min=1, help=f"Our target's: {MAX_CONTEXT_HELP}")]
OutOption = Annotated[Path, typer.Option(help="Output folder.")]


def bench(
    prompts: PromptsOption = None,
    categories: CategoriesOption = None,
    limit: LimitOption = None,
    target: TargetOption = "smollm2",
    draft: DraftOption = None,
    proposer: ProposersOption = "lookup,draft",
    head: HeadOption = None,
    tree_nodes: TreeNodesOption = None,
    heads: HeadsOption = None,
    gamma: GammasOption = "2,4,8",
    mode: ModesOption = "exact",
    max_new_tokens: MaxNewTokensOption = 128,
    temperature: TemperatureOption = 0.0,
    seed: BaseSeedOption = 0,
    dtype: BenchDtypeOption = "float32",
    quantization: QuantizationsOption = "auto",
    hf: HfOption = True,
    llamacpp: LlamacppOption = False,
    verify_curve: VerifyCurveOption = False,
    curve_repeats: CurveRepeatsOption = 5,
    warmup: WarmupOption = 1,
    max_context: MaxContextOption = None,
    threads: ThreadsOption = None,
    out: OutOption = Path("bench-out"),
    synthetic: SyntheticOption = None,
    rounds: RoundsOption = 2,
    llamacpp_python: LlamacppPythonOption = None,
) -> None:
    """Benchmark plain and speculative decoding on Spec-Bench-style workloads; write a report and plots.

    With --synthetic, measure loading and stepping models of real sizes instead (random weights)."""
    settings = BenchSettings(**locals())  # every parameter, as typer parsed it (nothing else is bound yet)
    from specdecode.bench import session

    console = Console(stderr=True)
    if synthetic is not None:
        from specdecode.commands.bench_synthetic import bench_synthetic, synthetic_shapes

        with usage_errors():
            shapes = synthetic_shapes(settings)
        bench_synthetic(shapes, rounds, threads, llamacpp, llamacpp_python, out, console)
        return
    with usage_errors():
        planned = session.plan(settings)  # everything cheap validated before loading models
        run = session.load(settings, planned, lambda text: console.print(f"[yellow]note:[/] {text}", soft_wrap=True))
        quiet_transformers()  # transformers' generate() warns about generation-config details on every call
        turns = sum(len(i.turns) for i in planned.items)
        names = ", ".join(m.name for m in run.methods)
        console.print(f"{len(planned.items)} questions ({turns} turns) × {len(run.methods)} methods: {names}")
        columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            curve = progress.add_task("verify-cost curve", total=curve_repeats + 1, visible=verify_curve)
            task = progress.add_task("warm-up, then questions × methods", total=len(planned.items) * len(run.methods))
            result = session.measure(
                settings, planned, run, on_curve_step=lambda: progress.advance(curve),
                on_progress=lambda what: progress.update(task, advance=1, description=what),
            )  # fmt: skip
        _reported(result, settings.out, session.setup_of(settings, planned, run), console)


def _reported(result, out: Path, setup: dict, console: Console) -> None:
    """The report, results and plots written into --out, and the summary table printed."""
    from specdecode.bench.report import machine_info, summary_table, write_outputs

    written = write_outputs(result, out, machine_info(), setup)
    table, screen = summary_table(result), Console()
    natural = screen.measure(table, options=screen.options.update_width(1000)).maximum
    Console(width=max(screen.width, natural)).print(table)  # never squeeze columns
    console.print(f"wrote {', '.join(p.name for p in written)} in {out}")
