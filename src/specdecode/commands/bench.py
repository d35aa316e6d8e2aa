"""`specdecode bench`: our plain and speculative decoding per weight format vs transformers (and llama.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdecode.commands import MAX_CONTEXT_HELP, DraftOption, quiet_transformers, usage_errors

CURVE_MAX_K = 32
CURVE_CONTEXT = 500
QUANTIZATIONS = ("auto", "gguf", "gguf-a8", "int8", "int4", "none")


def _split(text: str | None, what: str) -> list[str]:
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if text is not None and not items:
        raise ValueError(f"{what} is empty")
    return items


def _gammas(text: str, allow_auto: bool = True) -> list[int | str]:
    try:
        gammas = [g if g == "auto" and allow_auto else int(g) for g in _split(text, "--gamma")]
    except ValueError:
        allowed = "integers >= 1 or auto" if allow_auto else "integers >= 1"
        raise ValueError(f"--gamma must be a comma list of {allowed}, got {text!r}") from None
    if any(g != "auto" and g < 1 for g in gammas):
        raise ValueError(f"--gamma values must be >= 1, got {text!r}")
    return gammas


def _tree_sizes(text: str | None) -> list[int]:
    if text is None:
        return []
    sizes = _split(text, "--tree-nodes")
    if not all(size.isdigit() for size in sizes):
        raise ValueError(f"--tree-nodes must be a comma list of integers >= 0 (0 = a chain), got {text!r}")
    return [int(size) for size in sizes]


def _quantizations(text: str) -> list[str]:
    settings = _split(text, "--quantization")
    unknown = [q for q in settings if q not in QUANTIZATIONS]
    if unknown:
        raise ValueError(f"unknown --quantization {unknown[0]!r}; choose from {', '.join(QUANTIZATIONS)}")
    repeated = [q for i, q in enumerate(settings) if q in settings[:i]]
    if repeated:
        raise ValueError(f"--quantization lists {repeated[0]!r} twice")
    return settings


PromptsOption = Annotated[
    Path | None,
    typer.Option(
        help="FastChat-format JSONL (question_id, category, turns), e.g. Spec-Bench's "
        "question.jsonl; default: a small built-in set."
    ),
]
CategoriesOption = Annotated[
    str | None,
    typer.Option(
        help="Comma list of subtasks (mt_bench, translation, summarization, qa, math_reasoning, "
        "rag) or raw categories to keep."
    ),
]
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
TemperatureOption = Annotated[
    float, typer.Option(help="0 = greedy (outputs checked against our plain decode); > 0 samples.")
]
DtypeOption = Annotated[
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
ThreadsOption = Annotated[int | None, typer.Option(help="torch threads, also llama.cpp's (default: torch's choice).")]
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


def bench(
    prompts: PromptsOption = None,
    categories: CategoriesOption = None,
    limit: Annotated[int | None, typer.Option(help="At most N questions per subtask.")] = None,
    target: Annotated[str, typer.Option(help="Target model: a bundled name, HF folder or .gguf.")] = "smollm2",
    draft: DraftOption = None,
    proposer: ProposersOption = "lookup,draft",
    head: HeadOption = None,
    tree_nodes: TreeNodesOption = None,
    heads: HeadsOption = None,
    gamma: GammasOption = "2,4,8",
    mode: ModesOption = "exact",
    max_new_tokens: Annotated[int, typer.Option(help="New-token budget, the same for every method.")] = 128,
    temperature: TemperatureOption = 0.0,
    seed: Annotated[int, typer.Option(help="Base seed when sampling (question i uses seed + i).")] = 0,
    dtype: DtypeOption = "float32",
    quantization: QuantizationsOption = "auto",
    hf: HfOption = True,
    llamacpp: LlamacppOption = False,
    verify_curve: VerifyCurveOption = False,
    curve_repeats: CurveRepeatsOption = 5,
    warmup: Annotated[int, typer.Option(help="Questions run untimed by every method first.")] = 1,
    max_context: Annotated[int | None, typer.Option(min=1, help=f"Our target's: {MAX_CONTEXT_HELP}")] = None,
    threads: ThreadsOption = None,
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("bench-out"),
    synthetic: SyntheticOption = None,
    rounds: RoundsOption = 2,
    llamacpp_python: LlamacppPythonOption = None,
) -> None:
    """Benchmark plain and speculative decoding on Spec-Bench-style workloads; write a report and plots.

    With --synthetic, measure loading and stepping models of real sizes instead (random weights)."""
    options = BenchOptions(**locals())  # every parameter, as typer parsed it (nothing else is bound yet)
    console = Console(stderr=True)
    if synthetic is not None:
        from specdecode.commands.bench_synthetic import bench_synthetic, synthetic_shapes

        with usage_errors():
            shapes = synthetic_shapes(options)
        bench_synthetic(shapes, rounds, threads, llamacpp, llamacpp_python, out, console)
        return
    with usage_errors():
        plan = _planned(options)  # everything cheap validated before loading models
        run = _loaded(options, plan, console)
        result = _measured(options, plan, run, console)
        _reported(options, plan, run, result, console)


@dataclass(frozen=True)
class BenchOptions:
    """``bench``'s options as given (see its parameters' help)."""

    prompts: Path | None
    categories: str | None
    limit: int | None
    target: str
    draft: str | None
    proposer: str
    head: str | None
    tree_nodes: str | None
    heads: str | None
    gamma: str
    mode: str
    max_new_tokens: int
    temperature: float
    seed: int
    dtype: str
    quantization: str
    hf: bool
    llamacpp: bool
    verify_curve: bool
    curve_repeats: int
    warmup: int
    max_context: int | None
    threads: int | None
    out: Path
    synthetic: str | None
    rounds: int
    llamacpp_python: str | None


@dataclass(frozen=True)
class _Plan:
    """The comma lists parsed and the questions chosen."""

    proposers: list[str]
    gammas: list[int | str]
    trees: list[int]
    modes: list[str]
    settings: list[str]  # the --quantization list
    items: list[Any]


@dataclass(frozen=True)
class _Run:
    """The models loaded and the methods to time."""

    config: Any  # bench.runner.BenchConfig
    targets: dict[str, Any]  # --quantization setting -> LoadedModel
    methods: list[Any]
    llamacpp_note: str | None
    curve_peers: dict[str, Any]


def _planned(options: BenchOptions) -> _Plan:
    """The comma lists parsed, the numbers checked, the questions read and the output folder made."""
    from specdecode.bench.workloads import default_items, load_items, select_items

    proposers = _split(options.proposer, "--proposer")
    gammas = _gammas(options.gamma)
    trees = _tree_sizes(options.tree_nodes)
    modes = _split(options.mode, "--mode")
    settings = _quantizations(options.quantization)
    if options.curve_repeats < 1:
        raise ValueError(f"--verify-curve-repeats must be >= 1, got {options.curve_repeats}")
    if options.threads is not None and options.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {options.threads}")
    items = load_items(options.prompts) if options.prompts is not None else default_items()
    items = select_items(items, _split(options.categories, "--categories") or None, options.limit)
    try:
        options.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --out folder {options.out}: {e.strerror or e}") from None
    return _Plan(proposers, gammas, trees, modes, settings, items)


def _loaded(options: BenchOptions, plan: _Plan, console: Console) -> _Run:
    """Every --quantization's target and the draft loaded, our methods on each, transformers' and llama.cpp's."""
    import torch

    import specdecode
    from specdecode.bench.llamacpp import gguf_file
    from specdecode.bench.methods import transformers_methods
    from specdecode.bench.runner import BenchConfig

    config = BenchConfig(
        max_new_tokens=options.max_new_tokens, temperature=options.temperature, seed=options.seed, warmup=options.warmup
    )
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    if "draft" in plan.proposers and options.draft is None:
        console.print("[yellow]note:[/] no --draft given: the draft proposer and assisted generation are skipped")
    try:
        gguf = gguf_file(options.target) if options.llamacpp else None
        targets = _targets(options, plan)
        shared_draft = options.draft
        if options.draft is not None and not options.draft.startswith(("self:", "skip:")):
            shared_draft = specdecode.load_model(options.draft, dtype=options.dtype)  # one draft for every setting
        methods = _our_methods(options, plan, targets, shared_draft)
        if options.hf:  # on dense weights, as before quantized targets existed: figures stay comparable
            dense = next((t for t in targets.values() if t.quantization is None), None)
            dense = dense or specdecode.load_model(options.target, dtype=options.dtype, quantization=None)
            methods += transformers_methods(dense, shared_draft, options.dtype)
    except (OSError, specdecode.SpecDecodeError) as e:
        raise ValueError(f"cannot load model: {e}") from None
    loaded = targets[plan.settings[0]]
    llamacpp_note, curve_peers = _llamacpp(options, config, gguf, loaded, methods, console)
    return _Run(config, targets, methods, llamacpp_note, curve_peers)


def _targets(options: BenchOptions, plan: _Plan) -> dict[str, Any]:
    """The target loaded in each --quantization setting."""
    import specdecode

    targets = {}
    for q in plan.settings:
        try:
            targets[q] = specdecode.load_model(
                options.target, dtype=options.dtype, quantization=None if q == "none" else q,
                max_context=options.max_context,
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"--quantization {q}: {e}") from None
    return targets


def _our_methods(options: BenchOptions, plan: _Plan, targets: dict[str, Any], shared_draft: Any) -> list[Any]:
    """Our plain and speculative methods on each setting's target (named ``...@setting`` when there are several)."""
    from specdecode.bench.methods import build_methods

    methods = []
    for q, model in targets.items():
        setting = q if len(plan.settings) > 1 else None
        methods += build_methods(
            model,
            plan.proposers,
            plan.gammas,
            shared_draft,
            transformers=False,
            dtype=options.dtype,
            modes=plan.modes,
            setting=setting,
            head=options.head,
            tree_nodes=plan.trees,
            heads=options.heads,
        )
    return methods


def _llamacpp(
    options: BenchOptions, config: Any, gguf: Path | None, loaded: Any, methods: list[Any], console: Console
) -> tuple[str | None, dict[str, Any]]:
    """(what the report says of llama.cpp, its verify forward for --verify-curve): llama.cpp's methods appended to
    ``methods`` when asked for, greedy and installed."""
    import torch

    from specdecode.bench.llamacpp import LlamaCppMissing, llamacpp_methods, llamacpp_verify_forward

    llamacpp_note = None
    if options.llamacpp and not config.greedy:
        llamacpp_note = "skipped: greedy only (--temperature 0)"
        console.print(
            "[yellow]note:[/] llama.cpp methods are greedy only: skipped at --temperature > 0", soft_wrap=True
        )
    elif options.llamacpp:
        try:
            methods += llamacpp_methods(gguf, torch.get_num_threads(), loaded.eos_token_ids)
            llamacpp_note = f"{gguf}, n_threads {torch.get_num_threads()}"
        except LlamaCppMissing as e:
            llamacpp_note = f"skipped: {e}"
            console.print(f"[yellow]note:[/] {e}", soft_wrap=True)
    curve_peers = {}
    if (
        options.verify_curve
        and options.llamacpp
        and llamacpp_note is not None
        and not llamacpp_note.startswith("skipped")
    ):
        curve_peers["llama.cpp"] = llamacpp_verify_forward(gguf, torch.get_num_threads(), CURVE_MAX_K)
    return llamacpp_note, curve_peers


def _measured(options: BenchOptions, plan: _Plan, run: _Run, console: Console) -> Any:
    """The verify-cost curve (--verify-curve), then every question through every method, under a progress bar."""
    from specdecode.bench.runner import run_bench
    from specdecode.bench.verify_curve import measure_verify_curves

    quiet_transformers()  # transformers' generate() warns about generation-config details on every call
    loaded = run.targets[plan.settings[0]]
    turns = sum(len(i.turns) for i in plan.items)
    console.print(
        f"{len(plan.items)} questions ({turns} turns) × {len(run.methods)} methods: "
        + ", ".join(m.name for m in run.methods)
    )
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        verify_cost = curves = None
        if options.verify_curve:
            task = progress.add_task("verify-cost curve", total=options.curve_repeats + 1)
            curves = measure_verify_curves(
                loaded, CURVE_MAX_K, CURVE_CONTEXT, options.curve_repeats, on_step=lambda: progress.advance(task),
                peers=run.curve_peers,
            )  # fmt: skip
            verify_cost = curves.relative()
        task = progress.add_task("warm-up, then questions × methods", total=len(plan.items) * len(run.methods))
        result = run_bench(
            loaded,
            plan.items,
            run.methods,
            run.config,
            verify_cost,
            on_progress=lambda what: progress.update(task, advance=1, description=what),
        )
        result.verify_milliseconds = None if curves is None else curves.milliseconds
    return result


def _reported(options: BenchOptions, plan: _Plan, run: _Run, result: Any, console: Console) -> None:
    """The report, results and plots written into --out, and the summary table printed."""
    from specdecode.bench.report import machine_info, summary_table, write_outputs

    machine = machine_info()
    setup = {
        "target": options.target,
        "dtype": options.dtype,
        "draft": options.draft,
        "prompts": str(options.prompts) if options.prompts is not None else "built-in default set",
        "categories": options.categories,
        "limit": options.limit,
        "proposers": plan.proposers,
        "gammas": plan.gammas,
        "modes": plan.modes,
        "quantization": plan.settings,
        "weights": {q: t.quantization for q, t in run.targets.items()},
        "llamacpp": run.llamacpp_note,
    }
    written = write_outputs(result, options.out, machine, setup)
    table, screen = summary_table(result), Console()
    natural = screen.measure(table, options=screen.options.update_width(1000)).maximum
    Console(width=max(screen.width, natural)).print(table)  # never squeeze columns
    console.print(f"wrote {', '.join(p.name for p in written)} in {options.out}")
