"""PNG figures of a bench: speedup by subtask, acceptance by position, speedup vs gamma, verify cost."""

from __future__ import annotations

from pathlib import Path

from ..errors import optional_import
from ..planner import VerifyCost, speedup
from .metrics import OVERALL, merged_stats
from .runner import BenchResult

optional_import("matplotlib", "bench", "the benchmark's plots").use("Agg")
plt = optional_import("matplotlib.pyplot", "bench", "the benchmark's plots")
MaxNLocator = optional_import("matplotlib.ticker", "bench", "the benchmark's plots").MaxNLocator


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_speedup_by_subtask(result: BenchResult, path: Path) -> Path | None:
    """Grouped bars: speedup over our plain decode per subtask (and overall), one bar per method."""
    subtasks = [*(s for s in result.aggregates if s != OVERALL), OVERALL]
    plains = {m.name for m in result.methods if m.ours_plain}
    methods = [m for m in result.aggregates[OVERALL] if m not in plains]
    if not methods:
        return None
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(7.0, (0.6 + 0.18 * len(methods)) * len(subtasks)), 4.5))
    cmap = plt.get_cmap("tab20")
    for j, method in enumerate(methods):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(subtasks))]
        ys = [result.aggregates[s].get(method, {}).get("speedup_vs_plain") or 0.0 for s in subtasks]
        ax.bar(xs, ys, width, label=method, color=cmap(j % 20))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(subtasks)), subtasks, rotation=20, ha="right")
    ax.set_ylabel("speedup over our plain decode (×)")
    ax.set_title("Speedup by subtask (mean per-question tokens/s ratio)")
    ax.legend(fontsize=8, ncol=2 if len(methods) > 6 else 1, bbox_to_anchor=(1.01, 1), loc="upper left")
    return _save(fig, path)


def plot_acceptance_by_position(result: BenchResult, path: Path) -> Path | None:
    """Conditional acceptance a_i at each draft position, one line per speculative method (overall)."""
    rows = {m: r["per_position"] for m, r in result.aggregates[OVERALL].items() if r["per_position"]}
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, rates in rows.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accept i | accepted < i)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (all subtasks)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_speedup_vs_gamma(result: BenchResult, path: Path) -> Path | None:
    """Measured speedup at each gamma (points) with the planner's curve from pooled α and c (line)."""
    proposers: dict[str, list] = {}  # one curve per proposer and quantization setting
    for spec in result.methods:
        if spec.family == "ours" and spec.gamma is not None and spec.name in result.aggregates[OVERALL]:
            label = spec.proposer if spec.setting is None else f"{spec.proposer}@{spec.setting}"
            proposers.setdefault(label, []).append(spec)
    proposers = {p: specs for p, specs in proposers.items() if len(specs) >= 2}
    if not proposers:
        return None
    curve = None
    if result.verify_cost:
        curve = VerifyCost.from_json({str(k): v for k, v in result.verify_cost.items()})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for j, (proposer, specs) in enumerate(sorted(proposers.items())):
        color = plt.get_cmap("tab10")(j)
        specs = sorted(specs, key=lambda s: s.gamma)
        rows = [result.aggregates[OVERALL][s.name] for s in specs]
        gammas = [s.gamma for s in specs]
        ax.plot(gammas, [r["speedup_vs_plain"] or 0.0 for r in rows], "o-", color=color, label=f"{proposer}: measured")
        stats = merged_stats(r for r in result.records if r.method in {s.name for s in specs})
        costs = [r["draft_cost"] for r in rows if r["draft_cost"] is not None]
        if stats is None or not stats.drafted or not costs:
            continue
        cost = sum(costs) / len(costs)
        top = max(gammas) if curve is None else min(max(gammas), curve.max_k - 1)
        grid = list(range(1, top + 1))
        ax.plot(
            grid,
            [speedup(stats.alpha, g, cost, curve) for g in grid],
            "--",
            color=color,
            label=f"{proposer}: planner (α={stats.alpha:.2f}, c={cost:.3f}"
            + (", measured v" if curve else ", v=1")
            + ")",
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("gamma (draft tokens per round)")
    ax.set_ylabel("speedup over our plain decode (×)")
    ax.set_title("Speedup against gamma: measured vs analytic")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_verify_cost(
    verify_cost: dict[int, float], path: Path, peers: dict[str, dict[int, float]] | None = None
) -> Path:
    """v(k) against k (ours, and each peer's from its milliseconds), with the ideal flat line (free
    verification) and the linear line (v = k)."""
    ks = sorted(verify_cost)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ks, [verify_cost[k] for k in ks], "o-", label="measured v(k)" if not peers else "ours")
    for name, ms in (peers or {}).items():
        ax.plot(ks, [ms[k] / ms[1] for k in ks], "s--", label=name)
    ax.plot(ks, [1.0] * len(ks), ":", color="gray", label="v = 1 (free)")
    ax.plot(ks, ks, ":", color="red", label="v = k (no batching gain)")
    top = max([*verify_cost.values(), *(ms[k] / ms[1] for ms in (peers or {}).values() for k in ks)])
    ax.set_ylim(0, max(top * 1.15, 2.0))
    ax.set_xlabel("k new tokens in one forward")
    ax.set_ylabel("forward time relative to k = 1")
    ax.set_title("Verify cost on a ~500-token cache (medians)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(result: BenchResult, out: Path) -> list[Path]:
    """Every figure that applies to this result, as PNGs in ``out``."""
    made = [
        plot_speedup_by_subtask(result, out / "speedup_by_subtask.png"),
        plot_acceptance_by_position(result, out / "acceptance_by_position.png"),
        plot_speedup_vs_gamma(result, out / "speedup_vs_gamma.png"),
    ]
    if result.verify_cost:
        peers = {k: v for k, v in (result.verify_milliseconds or {}).items() if k != "ours"}
        made.append(plot_verify_cost(result.verify_cost, out / "verify_cost.png", peers))
    return [p for p in made if p is not None]


def plot_plan_measurement(gammas, iid, per_position, measured: dict[int, float], title: str, path: Path) -> Path:
    """Predicted speedup against γ (i.i.d. α and per-position products) with the measured points."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(gammas, iid, "--", label="predicted: i.i.d. α")
    ax.plot(gammas, per_position, "-", label="predicted: per-position acceptance")
    if measured:
        ax.plot(list(measured), list(measured.values()), "o", color="black", label="measured")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("gamma (draft tokens per round)")
    ax.set_ylabel("speedup over our plain decode (×)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
