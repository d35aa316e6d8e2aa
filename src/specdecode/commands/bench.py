"""`specdecode bench`: our plain and speculative decoding per weight format vs transformers (and llama.cpp)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, TextIO

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdecode.commands import MAX_CONTEXT_HELP, quiet_transformers, usage_errors

CURVE_MAX_K = 32
CURVE_CONTEXT = 500
QUANTIZATIONS = ("auto", "gguf", "gguf-a8", "int8", "int4", "none")
SUMMARY_COLUMNS = ("load_s", "peak_rss_mb", "disk_written_mb", "prefill_500_s", "step_ms")


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


def bench(
    prompts: Annotated[
        Path | None,
        typer.Option(
            help="FastChat-format JSONL (question_id, category, turns), e.g. Spec-Bench's "
            "question.jsonl; default: a small built-in set."
        ),
    ] = None,
    categories: Annotated[
        str | None,
        typer.Option(
            help="Comma list of subtasks (mt_bench, translation, summarization, qa, math_reasoning, "
            "rag) or raw categories to keep."
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option(help="At most N questions per subtask.")] = None,
    target: Annotated[str, typer.Option(help="Target model: a bundled name, HF folder or .gguf.")] = "smollm2",
    draft: Annotated[
        str | None,
        typer.Option(
            help="Draft model (name, folder, .gguf), self:N = the target's first N layers (untrained early "
            "exit, a stand-in for a real draft), or skip:SKIP.json / skip:3,5,9-12 = the target without those "
            "layers (see tune-skip)."
        ),
    ] = None,
    proposer: Annotated[
        str,
        typer.Option(
            help="Comma list of our proposers: lookup, draft (draft needs --draft), eagle, medusa, suffix "
            "(remembers the run's earlier questions and answers, as a server does), eagle+suffix and eagle+lookup "
            "(copy where the text repeats, else the head guesses)."
        ),
    ] = "lookup,draft",
    head: Annotated[
        str | None, typer.Option(help="eagle: a head trained with train-head (default: the one shipped).")
    ] = None,
    tree_nodes: Annotated[
        str | None,
        typer.Option(help="eagle, medusa: comma list of token-tree sizes, one method each (0 = a chain)."),
    ] = None,
    heads: Annotated[
        str | None, typer.Option(help="medusa: heads trained with train-medusa (default: the ones shipped).")
    ] = None,
    gamma: Annotated[
        str, typer.Option(help="Comma list of gammas for each proposer; auto = adaptive (may pick 0).")
    ] = "2,4,8",
    mode: Annotated[
        str,
        typer.Option(
            help="Comma list of verification modes: exact (min(1, p/q)) and/or reproducible (same text as "
            "plain sampling with the same seed; differs from exact only when --temperature > 0)."
        ),
    ] = "exact",
    max_new_tokens: Annotated[int, typer.Option(help="New-token budget, the same for every method.")] = 128,
    temperature: Annotated[
        float, typer.Option(help="0 = greedy (outputs checked against our plain decode); > 0 samples.")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Base seed when sampling (question i uses seed + i).")] = 0,
    dtype: Annotated[
        str, typer.Option(help="float32 or bfloat16 (bfloat16 needs --quantization none: dense weights).")
    ] = "float32",
    quantization: Annotated[
        str,
        typer.Option(
            help="Comma list of target weight formats, each run with all our methods: auto (a GGUF target's own "
            "blocks, else dense), gguf, gguf-a8, int8, int4, none (dense). With several, method names end in "
            "@setting (ours:plain@gguf) and each is checked against its own plain decode."
        ),
    ] = "auto",
    hf: Annotated[
        bool,
        typer.Option(
            "--hf/--no-hf",
            help="Include transformers' generate (plain, prompt lookup, assisted), always on dense weights.",
        ),
    ] = True,
    llamacpp: Annotated[
        bool,
        typer.Option(
            "--llamacpp",
            help="Add llama.cpp's plain and prompt-lookup decoding on the target's GGUF file (needs "
            "llama-cpp-python, not a dependency; greedy only; outputs not expected to equal ours).",
        ),
    ] = False,
    verify_curve: Annotated[
        bool,
        typer.Option(
            "--verify-curve",
            "--quirk",
            help=f"Measure the verify-cost curve v(k), k = 1..{CURVE_MAX_K} (first --quantization's target; with "
            "--llamacpp, llama.cpp's on the same file too, every row's logits computed, interleaved). "
            "--quirk: deprecated alias.",
        ),
    ] = False,
    curve_repeats: Annotated[
        int,
        typer.Option(
            "--verify-curve-repeats",
            "--quirk-repeats",
            help="--verify-curve: timed sweeps over k (medians). --quirk-repeats: deprecated alias.",
        ),
    ] = 5,
    warmup: Annotated[int, typer.Option(help="Questions run untimed by every method first.")] = 1,
    max_context: Annotated[int | None, typer.Option(min=1, help=f"Our target's: {MAX_CONTEXT_HELP}")] = None,
    threads: Annotated[
        int | None, typer.Option(help="torch threads, also llama.cpp's (default: torch's choice).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("bench-out"),
    synthetic: Annotated[
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
    ] = None,
    rounds: Annotated[
        int, typer.Option(min=1, help="--synthetic: measurement rounds per file (engines alternated; medians).")
    ] = 2,
    llamacpp_python: Annotated[
        str | None,
        typer.Option(
            help="--synthetic: an interpreter with llama-cpp-python to run llama.cpp in (implies --llamacpp; "
            "default with --llamacpp: this one)."
        ),
    ] = None,
) -> None:
    """Benchmark plain and speculative decoding on Spec-Bench-style workloads; write a report and plots.

    With --synthetic, measure loading and stepping models of real sizes instead (random weights)."""
    console = Console(stderr=True)
    if synthetic is not None:
        with usage_errors():
            from specdecode.bench.synthetic import parse_shapes

            shapes = parse_shapes(synthetic)
            given = [name for name, value in (("--target", target != "smollm2"), ("--prompts", prompts is not None),
                     ("--draft", draft is not None), ("--verify-curve", verify_curve)) if value]  # fmt: skip
            if given:
                raise ValueError(f"--synthetic measures its own files: it takes no {given[0]}")
            if threads is not None and threads < 1:
                raise ValueError(f"--threads must be >= 1, got {threads}")
        _bench_synthetic(shapes, rounds, threads, llamacpp, llamacpp_python, out, console)
        return
    with usage_errors():
        # Validate everything cheap before loading models.
        from specdecode.bench.workloads import default_items, load_items, select_items

        proposers = _split(proposer, "--proposer")
        gammas = _gammas(gamma)
        trees = _tree_sizes(tree_nodes)
        modes = _split(mode, "--mode")
        settings = _quantizations(quantization)
        if curve_repeats < 1:
            raise ValueError(f"--verify-curve-repeats must be >= 1, got {curve_repeats}")
        if threads is not None and threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        items = load_items(prompts) if prompts is not None else default_items()
        items = select_items(items, _split(categories, "--categories") or None, limit)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create --out folder {out}: {e.strerror or e}") from None

        import torch

        import specdecode
        from specdecode.bench.llamacpp import LlamaCppMissing, gguf_file, llamacpp_methods, llamacpp_verify_forward
        from specdecode.bench.methods import build_methods, transformers_methods
        from specdecode.bench.report import machine_info, summary_table, write_outputs
        from specdecode.bench.runner import BenchConfig, run_bench
        from specdecode.bench.verify_curve import measure_verify_curves

        config = BenchConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, warmup=warmup)
        if threads is not None:
            torch.set_num_threads(threads)
        if "draft" in proposers and draft is None:
            console.print("[yellow]note:[/] no --draft given: the draft proposer and assisted generation are skipped")
        try:
            gguf = gguf_file(target) if llamacpp else None
            targets = {}
            for q in settings:
                try:
                    targets[q] = specdecode.load_model(
                        target, dtype=dtype, quantization=None if q == "none" else q, max_context=max_context
                    )
                except ValueError as e:
                    raise ValueError(f"--quantization {q}: {e}") from None
            shared_draft = draft
            if draft is not None and not draft.startswith(("self:", "skip:")):
                shared_draft = specdecode.load_model(draft, dtype=dtype)  # one draft for every setting
            methods = []
            for q, model in targets.items():
                setting = q if len(settings) > 1 else None
                methods += build_methods(
                    model,
                    proposers,
                    gammas,
                    shared_draft,
                    transformers=False,
                    dtype=dtype,
                    modes=modes,
                    setting=setting,
                    head=head,
                    tree_nodes=trees,
                    heads=heads,
                )
            if hf:  # on dense weights, as before quantized targets existed: figures stay comparable
                dense = next((t for t in targets.values() if t.quantization is None), None)
                dense = dense or specdecode.load_model(target, dtype=dtype, quantization=None)
                methods += transformers_methods(dense, shared_draft, dtype)
        except (OSError, specdecode.SpecDecodeError) as e:
            raise ValueError(f"cannot load model: {e}") from None
        loaded = targets[settings[0]]
        llamacpp_note = None
        if llamacpp and not config.greedy:
            llamacpp_note = "skipped: greedy only (--temperature 0)"
            console.print(
                "[yellow]note:[/] llama.cpp methods are greedy only: skipped at --temperature > 0", soft_wrap=True
            )
        elif llamacpp:
            try:
                methods += llamacpp_methods(gguf, torch.get_num_threads(), loaded.eos_token_ids)
                llamacpp_note = f"{gguf}, n_threads {torch.get_num_threads()}"
            except LlamaCppMissing as e:
                llamacpp_note = f"skipped: {e}"
                console.print(f"[yellow]note:[/] {e}", soft_wrap=True)
        curve_peers = {}
        if verify_curve and llamacpp and llamacpp_note is not None and not llamacpp_note.startswith("skipped"):
            curve_peers["llama.cpp"] = llamacpp_verify_forward(gguf, torch.get_num_threads(), CURVE_MAX_K)
        quiet_transformers()  # transformers' generate() warns about generation-config details on every call
        turns = sum(len(i.turns) for i in items)
        console.print(
            f"{len(items)} questions ({turns} turns) × {len(methods)} methods: " + ", ".join(m.name for m in methods)
        )
        columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            verify_cost = curves = None
            if verify_curve:
                task = progress.add_task("verify-cost curve", total=curve_repeats + 1)
                curves = measure_verify_curves(
                    loaded, CURVE_MAX_K, CURVE_CONTEXT, curve_repeats, on_step=lambda: progress.advance(task),
                    peers=curve_peers,
                )  # fmt: skip
                verify_cost = curves.relative()
            task = progress.add_task("warm-up, then questions × methods", total=len(items) * len(methods))
            result = run_bench(
                loaded,
                items,
                methods,
                config,
                verify_cost,
                on_progress=lambda what: progress.update(task, advance=1, description=what),
            )
            result.verify_milliseconds = None if curves is None else curves.milliseconds
        machine = machine_info()
        setup = {
            "target": target,
            "dtype": dtype,
            "draft": draft,
            "prompts": str(prompts) if prompts is not None else "built-in default set",
            "categories": categories,
            "limit": limit,
            "proposers": proposers,
            "gammas": gammas,
            "modes": modes,
            "quantization": settings,
            "weights": {q: t.quantization for q, t in targets.items()},
            "llamacpp": llamacpp_note,
        }
        written = write_outputs(result, out, machine, setup)
        table, screen = summary_table(result), Console()
        natural = screen.measure(table, options=screen.options.update_width(1000)).maximum
        Console(width=max(screen.width, natural)).print(table)  # never squeeze columns
        console.print(f"wrote {', '.join(p.name for p in written)} in {out}")


def _bench_synthetic(
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
