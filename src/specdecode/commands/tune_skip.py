"""`specdecode tune-skip`: search which layers a self-draft skips (predicted, then measured), write SKIP.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specdecode import factory
from specdecode.commands import err, progress_bar, quiet_transformers
from specdecode.commands.options import CategoriesOption, LimitOption, PromptsOption, QuantizationOption, TargetOption

OutOption = Annotated[Path, typer.Option(help="Where to write the skip set (JSON), for --draft skip:FILE.")]
NewTokensOption = Annotated[int, typer.Option(help="Tokens of the target's greedy continuation replayed per prompt.")]
MaxSkipOption = Annotated[int | None, typer.Option(help="Most layers skipped (default: half the target's layers).")]
MaxGammaOption = Annotated[int, typer.Option(help="Largest gamma considered for each set.")]
ConfirmOption = Annotated[
    int, typer.Option(help="Best predicted sets measured end to end against plain decoding (0 = trust the prediction).")
]


def tune_skip(
    out: OutOption,
    target: TargetOption = "smollm2",
    prompts: PromptsOption = None,
    categories: CategoriesOption = None,
    limit: LimitOption = None,
    new_tokens: NewTokensOption = 64,
    max_skip: MaxSkipOption = None,
    max_gamma: MaxGammaOption = 8,
    confirm: ConfirmOption = 3,
    quantization: QuantizationOption = "auto",
) -> None:
    """Choose the layers a self-speculation draft skips, to maximise tokens/s; use it with --draft skip:FILE.

    Greedy search: each step skips one more layer, the one whose removal predicts the highest speedup, where
    the prediction replays the target's own greedy continuations of the prompts (a guess is accepted exactly
    when the draft's argmax is the target's token) at the step cost of the kept layers and this machine's
    verify cost v(k). The best few sets are then run end to end by the bench; the measured best is written.
    """
    from specdecode.bench import skip_search
    from specdecode.bench.workloads import build_prompt
    from specdecode.planner import VerifyCost
    from specdecode.proposers.layer_skip import SkipSet, layer_count

    settings = skip_search.SearchSettings(new_tokens, max_skip, max_gamma, confirm)
    if out.is_dir():
        raise IsADirectoryError(f"--out must be a file path, got the folder {out}")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--out's folder does not exist: {out.parent}")
    items = _tuning_items(prompts, categories, limit)
    quiet_transformers()
    with err.status(f"loading {target}…"):
        model = factory.load(target, "float32", quantization)
    layers = layer_count(model)
    ids = [build_prompt(model, item.turns, []) for item in items]
    bar, task = progress_bar("tune-skip")
    with bar:
        bar.update(task, total=len(ids), completed=0, info="the target's continuations")
        runs = skip_search.continuations(model, ids, settings.new_tokens, lambda: bar.advance(task))
        bar.update(task, total=None, info="timing steps and v(k)")
        from specdecode.bench.verify_curve import measure_verify_cost

        step = skip_search.step_cost(model)
        verify = VerifyCost.from_json(
            {str(k): v for k, v in measure_verify_cost(model, max_gamma + 1, repeats=3).items()}
        )
        depth = min(settings.max_skip or layers // 2, layers - 1)
        bar.update(task, total=sum(layers - s for s in range(depth)), completed=0, info="searching")

        def on_candidate(c: skip_search.Candidate) -> None:
            bar.update(task, advance=1, info=f"{len(c.skip)} skipped: {c.predicted:.2f}× predicted")

        path = skip_search.greedy_path(model, runs, step, verify, settings, on_candidate)
        finalists = skip_search.finalists(path, settings.confirm)
        confirmed = []
        if finalists:
            bar.update(task, total=None, info="measuring the finalists against plain")
            confirmed = skip_search.confirm(model, items, finalists, settings.new_tokens)
    best = max(confirmed, key=lambda c: c.speedup).candidate if confirmed else skip_search.finalists(path, 1)[0]
    measured = {c.candidate.skip: c for c in confirmed}
    pays = best.skip in measured and measured[best.skip].speedup > 1.0
    search = {
        "prompts": len(runs),
        "tokens": sum(len(r.tokens) - r.prompt_length for r in runs),
        "step_cost": {"fixed_ms": step.fixed_ms, "per_layer_ms": step.per_layer_ms},
        "verify_cost": dict(verify.points),
        "gamma": best.gamma,
        "path": [c.to_json() for c in path],
        "confirmed": [c.to_json() for c in confirmed],
        "pays": pays,
    }
    SkipSet(model.name, layers, best.skip, search).save(out)
    _print_report(path, confirmed, best, pays, out)


def _tuning_items(prompts: Path | None, categories: str | None, limit: int | None) -> list:
    """The first turns of the prompts to tune on (``--prompts``, or the bench's built-in set), refused if none."""
    from specdecode.bench.workloads import WorkItem, default_items, load_items, select_items

    items = load_items(prompts) if prompts is not None else default_items()
    wanted = [c.strip() for c in categories.split(",") if c.strip()] if categories else None
    items = [WorkItem(i.question_id, i.category, i.turns[:1]) for i in select_items(items, wanted, limit)]
    if not items:
        raise ValueError("no prompts to tune on: check --prompts, --categories and --limit")
    return items


def _print_report(path, confirmed, best, pays: bool, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="greedy path (predicted)")
    for column in ("skipped", "layers", "acceptance", "c", "γ", "tokens/round", "speedup", "flat v(k)"):
        table.add_column(column, justify="right")
    for c in path:
        table.add_row(
            str(len(c.skip)), ",".join(map(str, c.skip)), f"{c.acceptance:.2f}", f"{c.cost:.2f}", str(c.gamma),
            f"{c.tokens_per_round:.2f}", f"{c.predicted:.2f}×", f"{c.flat:.2f}×",
        )  # fmt: skip
    console = Console()
    console.print(table)
    if confirmed:
        measured = Table(title="finalists, measured against plain (greedy)")
        for column in ("layers", "γ", "acceptance", "tokens/pass", "c", "tok/s", "plain tok/s", "speedup", "differ"):
            measured.add_column(column, justify="right")
        for m in confirmed:
            measured.add_row(
                ",".join(map(str, m.candidate.skip)), str(m.candidate.gamma), f"{m.acceptance:.2f}",
                f"{m.tokens_per_pass:.2f}", "—" if m.draft_cost is None else f"{m.draft_cost:.2f}",
                f"{m.tokens_per_second:.1f}", f"{m.plain_tokens_per_second:.1f}", f"{m.speedup:.2f}×", str(m.differing),
            )  # fmt: skip
        console.print(measured)
    if not confirmed:
        verdict = f"not measured (--confirm 0), predicted {best.predicted:.2f}× plain"
    else:
        verdict = "pays" if pays else "does not pay on this machine (kept as the best found)"
    console.print(
        f"wrote {out}: skip {len(best.skip)} layers ({','.join(map(str, best.skip))}), γ={best.gamma}; {verdict}; "
        f"with a flat verify cost (a GPU) the prediction is {best.flat:.2f}×. Use it: --draft skip:{out}",
        soft_wrap=True,
        highlight=False,
    )
