"""Bench output: results.json (records + aggregates + machine), report.md and the on-screen table."""

from __future__ import annotations

import json
import math
import platform
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from rich.table import Table

from ..version import __version__
from .methods import HF_PLAIN, MethodSpec
from .metrics import OVERALL
from .runner import BenchResult


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
                "amx_int8", "amx_bf16", "asimd", "sve")  # fmt: skip


def vector_extensions() -> list[str]:
    """The CPU's vector extensions that matter to the kernels and to torch (from /proc/cpuinfo's flags; empty
    elsewhere): a table's figures hold for a CPU with the same ones."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                return [flag for flag in VECTOR_FLAGS if flag in flags]
    except OSError:
        pass
    return []


def machine_info(argv: Sequence[str] | None = None) -> dict:
    """Where and how the bench ran: CPU, threads, library versions, command line, time."""
    import os

    import torch
    import transformers

    return {
        "specdecode": __version__,
        "cpu": cpu_model(),
        "vector_extensions": vector_extensions(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(sys.argv if argv is None else argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(machine: dict) -> str:
    """``machine_info`` in one line: CPU, cores, threads and vector extensions, then the versions and the date."""
    gpu = f", GPU {machine['cuda']}" if machine.get("cuda") else ""
    vectors = ", ".join(machine.get("vector_extensions") or ["no vector extensions read"])
    return (
        f"{machine.get('cpu')} ({machine.get('cpu_count')} CPUs, torch threads {machine.get('torch_threads')}{gpu}; "
        f"{vectors}); specdecode {machine.get('specdecode')}, torch {machine.get('torch')}, "
        f"transformers {machine.get('transformers')}; {machine.get('date')}"
    )


def _clean(value):
    """JSON-safe: NaN/inf become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def results_dict(result: BenchResult, machine: dict, setup: dict) -> dict:
    """Everything the bench measured, JSON-ready."""
    return _clean(
        {
            "machine": machine,
            "setup": setup,
            "config": {
                "max_new_tokens": result.config.max_new_tokens,
                "temperature": result.config.temperature,
                "seed": result.config.seed,
                "warmup": result.config.warmup,
            },
            "methods": [vars(m) for m in result.methods],
            "baselines": result.baselines,
            "verify_cost": result.verify_cost,
            "verify_milliseconds": result.verify_milliseconds,
            "aggregates": result.aggregates,
            "records": [r.to_dict() for r in result.records],
        }
    )


def write_json(result: BenchResult, path: Path, machine: dict, setup: dict) -> None:
    path.write_text(json.dumps(results_dict(result, machine, setup), indent=1) + "\n")


def _f(value, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _pct(value) -> str:
    return "–" if value is None else f"{value:.1%}"


def _subtasks(result: BenchResult) -> list[str]:
    return [s for s in result.aggregates if s != OVERALL]


COLUMNS = (
    "method",
    "weights",
    "tok/s",
    "× ours plain",
    "× hf plain",
    "tokens/pass",
    "accept",
    "α",
    "c",
    "predicted ×",
    "decode ×",
    "predicted (k̄) ×",
    "not identical",
    "other time",
)
SHORT_COLUMNS = (
    "method",
    "weights",
    "tok/s",
    "×plain",
    "×hf",
    "tok/pass",
    "accept",
    "α",
    "c",
    "pred ×",
    "dec ×",
    "pred k̄ ×",
    "≠plain",
    "other",
)


def _identity(row: dict) -> str:
    """``k/n`` outputs differing from our plain decode; ``(k/n same)`` for methods not expected to match it."""
    if row["non_identical"] is not None:
        return f"{row['non_identical']}/{row['turns']}"
    if row.get("same_as_plain") is not None:
        return f"({row['same_as_plain']}/{row['turns']} same)"
    return "–"


def _row(method: str, row: dict, specs: dict[str, MethodSpec]) -> list[str]:
    return [
        method,
        specs[method].weights if method in specs else "–",
        _f(row["tokens_per_second"], ".1f"),
        _f(row["speedup_vs_plain"], ".2f", "×"),
        _f(row["speedup_vs_hf_plain"], ".2f", "×"),
        _f(row["tokens_per_pass"]),
        _pct(row["acceptance_rate"]),
        _f(row["alpha"]),
        _f(row["draft_cost"], ".3f"),
        _f(row["predicted_speedup"], ".2f", "×"),
        _f(row.get("decode_speedup_vs_plain"), ".2f", "×"),
        _f(row.get("predicted_from_drafted"), ".2f", "×"),
        _identity(row),
        _pct(row["other_share"]),
    ]


def summary_table(result: BenchResult, subtask: str = OVERALL) -> Table:
    """The rich table printed at the end of a bench: one row per method."""
    table = Table(title=f"specdecode bench — {subtask}")
    for name in SHORT_COLUMNS:
        if name == "method":
            table.add_column(name, no_wrap=True)
        else:
            table.add_column(name, justify="right")
    specs = {m.name: m for m in result.methods}
    baselines = set(result.baselines)
    for method, row in result.aggregates[subtask].items():
        table.add_row(*_row(method, row, specs), style="bold" if method in baselines else None)
    return table


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def markdown_report(result: BenchResult, machine: dict, setup: dict, figures: Sequence[str]) -> str:
    """report.md: setup, the overall table, speedup by subtask, per-position acceptance, costs, figures."""
    specs = {m.name: m for m in result.methods}
    lines = _setup_lines(result, machine, setup)
    lines += ["## Overall", ""]
    lines += _md_table(COLUMNS, [_row(m, row, specs) for m, row in result.aggregates[OVERALL].items()])
    lines += _by_subtask_lines(result)
    lines += _acceptance_lines(result)
    lines += _pass_time_lines(result)
    for subtask in _subtasks(result):
        lines += [f"## {subtask}", ""]
        lines += _md_table(COLUMNS, [_row(m, row, specs) for m, row in result.aggregates[subtask].items()])
    lines += _verify_cost_lines(result)
    notes = [m for m in result.methods if m.description]
    lines += ["## Methods", ""] + [f"- `{m.name}`: {m.description}" for m in notes] + [""]
    if str(setup.get("draft") or "").startswith("skip:"):
        lines += [
            "`skip:...` drafts with the target minus the listed layers (a skip set chosen by `tune-skip`), sharing",
            "the target's weights.",
            "",
        ]
    if str(setup.get("draft") or "").startswith("self:"):
        lines += [
            "`self:N` drafts with the target's own first N layers and its LM head, untrained: a stand-in",
            "for a real draft model, to exercise the draft-model path.",
            "",
        ]
    if figures:
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures] + [""]
    return "\n".join(lines)


def _setup_lines(result: BenchResult, machine: dict, setup: dict) -> list[str]:
    """The report's title, its setup (command, models, weights, workload, sampling, machine) and how to read it."""
    cfg = result.config
    sampling = "greedy" if cfg.greedy else f"temperature {cfg.temperature} (seeded; no identity check)"
    n_questions = len({(r.subtask, r.question_id) for r in result.records})
    return [
        "# specdecode bench",
        "",
        f"- command: `{machine['command']}`",
        f"- target: {setup.get('target')} ({setup.get('dtype')}); draft: {setup.get('draft') or 'none'}",
        *_weights_lines(result, setup),
        f"- workload: {setup.get('prompts')}, {n_questions} questions, {len(result.records)} timed generations "
        f"in subtasks {', '.join(_subtasks(result))}",
        f"- {sampling}, max_new_tokens {cfg.max_new_tokens}, warm-up {cfg.warmup} question(s)",
        f"- machine: {machine_line(machine)}",
        "",
        "Methods run in one process (one loaded target per --quantization setting), interleaved per question",
        "in a rotating order. weights = how the target's weights are stored (dense = unquantized floats).",
        "tok/s is Spec-Bench's: the mean over questions of (new tokens / wall seconds), prefill included;",
        "speedup (×) is the ratio of those means; × ours plain is over our plain decode of the same",
        "--quantization setting (for transformers' and llama.cpp's methods: on the same weights, else the",
        "first setting's). tokens/pass = new tokens per target forward (bonus included); accept = accepted /",
        "drafted; α = accepted / (accepted + rejections); c = draft seconds per drafted token / target",
        "seconds per 1-token step (from our plain decode of the same setting); predicted × is the",
        "planner's E(α, γ) / (v(γ+1) + γc) with "
        + ("the measured verify-cost curve v;" if result.verify_cost else "v = 1 (no --verify-curve measured);"),
        "it ignores prefill and loop overhead and assumes γ drafted tokens every round (prompt lookup often",
        "drafts fewer). decode × = speedup over our plain decode with prefill time left out (what the planner",
        "models); predicted (k̄) × = tokens/pass / (v(k̄+1) + k̄c) with k̄ the mean drafted tokens per pass, the",
        "planner's ratio for the acceptance process actually measured. not identical = greedy outputs (per",
        "turn) that differ from our plain decode of the same setting, token for token; in parentheses, for",
        "methods not expected to match it (llama.cpp, or other weights), how many turns equal it anyway.",
        "other time = share of wall time outside prefill, draft and verify.",
        "",
    ]


def _by_subtask_lines(result: BenchResult) -> list[str]:
    """Speedup over our plain decode and over transformers' (when run), and tokens/s, per subtask."""
    subtasks = _subtasks(result)
    methods = list(result.aggregates[OVERALL])
    ours_plain = any(m.ours_plain for m in result.methods)
    lines: list[str] = []
    for title, present, key in (
        ("our plain decode (same setting)", ours_plain, "speedup_vs_plain"),
        (HF_PLAIN, HF_PLAIN in methods, "speedup_vs_hf_plain"),
    ):
        if not present:
            continue
        lines += [f"## Speedup over {title} by subtask", ""]
        rows = [
            [m] + [_f(result.aggregates[s].get(m, {}).get(key), ".2f", "×") for s in [*subtasks, OVERALL]]
            for m in methods
        ]
        lines += _md_table(["method", *subtasks, OVERALL], rows)
    lines += ["## Tokens per second by subtask", ""]
    rows = [
        [m] + [_f(result.aggregates[s].get(m, {}).get("tokens_per_second"), ".1f") for s in [*subtasks, OVERALL]]
        for m in methods
    ]
    lines += _md_table(["method", *subtasks, OVERALL], rows)
    return lines


def _acceptance_lines(result: BenchResult) -> list[str]:
    """Conditional acceptance by draft position, for the methods that draft."""
    lines: list[str] = []
    speculative = {m: row for m, row in result.aggregates[OVERALL].items() if row["per_position"]}
    if speculative:
        width = max(len(row["per_position"]) for row in speculative.values())
        lines += [
            "## Acceptance by draft position (overall)",
            "",
            "Conditional acceptance a_i = P(position i accepted | positions < i accepted).",
            "",
        ]
        rows = [
            [m] + [_pct(row["per_position"][i]) if i < len(row["per_position"]) else "–" for i in range(width)]
            for m, row in speculative.items()
        ]
        lines += _md_table(["method", *(str(i + 1) for i in range(width))], rows)
    return lines


def _pass_time_lines(result: BenchResult) -> list[str]:
    """Drafted tokens, draft and verify milliseconds per target pass, and the verify pass over a plain step."""
    lines: list[str] = []
    split = {m: row for m, row in result.aggregates[OVERALL].items() if row.get("verify_ms_per_pass") is not None}
    if split:
        lines += [
            "## Time per target pass (overall)",
            "",
            "Drafted tokens (a tree's nodes) per pass, milliseconds drafting and verifying per pass, and the verify",
            "pass relative to a plain 1-token step of the same weights: where a speculative method loses, this says",
            "whether acceptance (tokens/pass) or cost (draft + verify) is short.",
            "",
        ]
        rows = [
            [
                m,
                _f(row["drafted_per_pass"]),
                _f(row["tokens_per_pass"]),
                _f(row["draft_ms_per_pass"]),
                _f(row["verify_ms_per_pass"]),
                _f(row["verify_ratio"]),
            ]
            for m, row in split.items()
        ]
        header = ["method", "drafted/pass", "tokens/pass", "draft ms/pass", "verify ms/pass", "verify ÷ plain step"]
        lines += _md_table(header, rows)
    return lines


def _verify_cost_lines(result: BenchResult) -> list[str]:
    """The measured verify-cost curve v(k), ours and any peer's, in milliseconds and relative to k = 1."""
    lines: list[str] = []
    if result.verify_cost:
        lines += [
            "## Verify cost v(k) (--verify-curve)",
            "",
            "Forward time for k new tokens on a ~500-token cache, relative to k = 1 (medians).",
            "",
        ]
        ks = sorted(result.verify_cost)
        rows = [["v(k)", *(f"{result.verify_cost[k]:.2f}" for k in ks)]]
        for engine, ms in (result.verify_milliseconds or {}).items():
            name = "ours" if engine == "ours" else engine
            rows.append([f"{name}, ms", *(f"{ms[k]:.2f}" for k in ks)])
            if engine != "ours":
                rows.append([f"{name}, v(k)", *(f"{ms[k] / ms[1]:.2f}" for k in ks)])
        lines += _md_table(["k", *map(str, ks)], rows)
    return lines


def _weights_lines(result: BenchResult, setup: dict) -> list[str]:
    """The setup lines on target weights: each --quantization setting and what the peers ran on."""
    weights = setup.get("weights") or {}
    lines = []
    if setup.get("quantization"):
        settings = ", ".join(f"{q} = {weights.get(q) or 'dense'}" for q in setup["quantization"])
        lines.append(f"- target weights (--quantization): {settings}; each runs every one of our methods")
    peers = sorted({f"{m.family} on {m.weights} weights" for m in result.methods if m.family != "ours"})
    if peers:
        lines.append(f"- peers: {', '.join(peers)}")
    if setup.get("llamacpp"):
        lines.append(f"- llama.cpp: {setup['llamacpp']}")
    return lines


def write_outputs(result: BenchResult, out: Path, machine: dict, setup: dict) -> list[Path]:
    """results.json, report.md and the PNG figures in ``out``; returns every path written."""
    from .plots import write_plots  # deferred: matplotlib is slow to import

    out.mkdir(parents=True, exist_ok=True)
    figures = write_plots(result, out)
    write_json(result, out / "results.json", machine, setup)
    (out / "report.md").write_text(markdown_report(result, machine, setup, [str(f) for f in figures]))
    return [out / "results.json", out / "report.md", *figures]
