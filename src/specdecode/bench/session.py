"""One ``specdecode bench`` run from its settings: the comma lists parsed and the questions chosen (``plan``), every
target and method loaded (``load``), the verify-cost curve and the workloads measured (``measure``), and the setup
the report records (``setup_of``). The command parses its options into ``BenchSettings`` and shows progress."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.loaded import LoadedModel
from .runner import BenchConfig, BenchResult

CURVE_MAX_K = 32
CURVE_CONTEXT = 500
QUANTIZATIONS = ("auto", "gguf", "gguf-a8", "int8", "int4", "none")


def split_list(text: str | None, what: str) -> list[str]:
    """A comma list's items (empty for None), refused in one line naming the option ``what`` if it is empty."""
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if text is not None and not items:
        raise ValueError(f"{what} is empty")
    return items


def parse_gammas(text: str, allow_auto: bool = True) -> list[int | str]:
    """``--gamma``'s comma list: integers >= 1 (and ``auto``)."""
    try:
        gammas = [g if g == "auto" and allow_auto else int(g) for g in split_list(text, "--gamma")]
    except ValueError:
        allowed = "integers >= 1 or auto" if allow_auto else "integers >= 1"
        raise ValueError(f"--gamma must be a comma list of {allowed}, got {text!r}") from None
    if any(g != "auto" and g < 1 for g in gammas):
        raise ValueError(f"--gamma values must be >= 1, got {text!r}")
    return gammas


def parse_tree_sizes(text: str | None) -> list[int]:
    """``--tree-nodes``' comma list: integers >= 0 (0 = a chain)."""
    if text is None:
        return []
    sizes = split_list(text, "--tree-nodes")
    if not all(size.isdigit() for size in sizes):
        raise ValueError(f"--tree-nodes must be a comma list of integers >= 0 (0 = a chain), got {text!r}")
    return [int(size) for size in sizes]


def parse_quantizations(text: str) -> list[str]:
    """``--quantization``'s comma list of weight settings, each once."""
    settings = split_list(text, "--quantization")
    unknown = [q for q in settings if q not in QUANTIZATIONS]
    if unknown:
        raise ValueError(f"unknown --quantization {unknown[0]!r}; choose from {', '.join(QUANTIZATIONS)}")
    repeated = [q for i, q in enumerate(settings) if q in settings[:i]]
    if repeated:
        raise ValueError(f"--quantization lists {repeated[0]!r} twice")
    return settings


@dataclass(frozen=True)
class BenchSettings:
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
class BenchPlan:
    """The comma lists parsed and the questions chosen."""

    proposers: list[str]
    gammas: list[int | str]
    trees: list[int]
    modes: list[str]
    settings: list[str]  # the --quantization list
    items: list[Any]


@dataclass(frozen=True)
class BenchRun:
    """The models loaded and the methods to time."""

    config: BenchConfig
    targets: dict[str, LoadedModel]  # --quantization setting -> target
    methods: list[Any]
    llamacpp_note: str | None
    curve_peers: dict[str, Any]

    @property
    def first_target(self) -> LoadedModel:
        """The first --quantization's target: the verify-cost curve's and the outputs' reference."""
        return next(iter(self.targets.values()))


def plan(settings: BenchSettings) -> BenchPlan:
    """The comma lists parsed, the numbers checked, the questions read and the output folder made."""
    from .workloads import default_items, load_items, select_items

    proposers = split_list(settings.proposer, "--proposer")
    gammas = parse_gammas(settings.gamma)
    trees = parse_tree_sizes(settings.tree_nodes)
    modes = split_list(settings.mode, "--mode")
    quantizations = parse_quantizations(settings.quantization)
    if settings.curve_repeats < 1:
        raise ValueError(f"--verify-curve-repeats must be >= 1, got {settings.curve_repeats}")
    if settings.threads is not None and settings.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {settings.threads}")
    items = load_items(settings.prompts) if settings.prompts is not None else default_items()
    items = select_items(items, split_list(settings.categories, "--categories") or None, settings.limit)
    try:
        settings.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --out folder {settings.out}: {e.strerror or e}") from None
    return BenchPlan(proposers, gammas, trees, modes, quantizations, items)


def load(settings: BenchSettings, planned: BenchPlan, note: Callable[[str], None]) -> BenchRun:
    """Every --quantization's target and the draft loaded, our methods on each, transformers' and llama.cpp's;
    ``note`` says what is skipped and why."""
    import torch

    from ..errors import SpecDecodeError
    from ..models.loading.loader import load_model
    from .llamacpp import gguf_file
    from .methods import transformers_methods

    config = BenchConfig(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        seed=settings.seed,
        warmup=settings.warmup,
    )
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    if "draft" in planned.proposers and settings.draft is None:
        note("no --draft given: the draft proposer and assisted generation are skipped")
    try:
        gguf = gguf_file(settings.target) if settings.llamacpp else None
        targets = _targets(settings, planned)
        shared_draft = settings.draft
        if settings.draft is not None and not settings.draft.startswith(("self:", "skip:")):
            shared_draft = load_model(settings.draft, dtype=settings.dtype)  # one draft for every setting
        methods = _our_methods(settings, planned, targets, shared_draft)
        if settings.hf:  # on dense weights, as before quantized targets existed: figures stay comparable
            dense = next((t for t in targets.values() if t.quantization is None), None)
            dense = dense or load_model(settings.target, dtype=settings.dtype, quantization=None)
            methods += transformers_methods(dense, shared_draft, settings.dtype)
    except (OSError, SpecDecodeError) as e:
        raise ValueError(f"cannot load model: {e}") from None
    llamacpp_note, curve_peers = _llamacpp(settings, config, gguf, targets[planned.settings[0]], methods, note)
    return BenchRun(config, targets, methods, llamacpp_note, curve_peers)


def _targets(settings: BenchSettings, planned: BenchPlan) -> dict[str, LoadedModel]:
    """The target loaded in each --quantization setting."""
    from ..models.loading.loader import load_model

    targets = {}
    for q in planned.settings:
        try:
            targets[q] = load_model(
                settings.target, dtype=settings.dtype, quantization=None if q == "none" else q,
                max_context=settings.max_context,
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"--quantization {q}: {e}") from None
    return targets


def _our_methods(
    settings: BenchSettings, planned: BenchPlan, targets: dict[str, LoadedModel], shared_draft: Any
) -> list[Any]:
    """Our plain and speculative methods on each setting's target (named ``...@setting`` when there are several)."""
    from .methods import build_methods

    methods = []
    for q, model in targets.items():
        setting = q if len(planned.settings) > 1 else None
        methods += build_methods(
            model,
            planned.proposers,
            planned.gammas,
            shared_draft,
            transformers=False,
            dtype=settings.dtype,
            modes=planned.modes,
            setting=setting,
            head=settings.head,
            tree_nodes=planned.trees,
            heads=settings.heads,
        )
    return methods


def _llamacpp(
    settings: BenchSettings,
    config: BenchConfig,
    gguf: Path | None,
    loaded: LoadedModel,
    methods: list[Any],
    note: Callable[[str], None],
) -> tuple[str | None, dict[str, Any]]:
    """(what the report says of llama.cpp, its verify forward for --verify-curve): llama.cpp's methods appended to
    ``methods`` when asked for, greedy and installed."""
    import torch

    from .llamacpp import LlamaCppMissing, llamacpp_methods, llamacpp_verify_forward

    llamacpp_note = None
    if settings.llamacpp and not config.greedy:
        llamacpp_note = "skipped: greedy only (--temperature 0)"
        note("llama.cpp methods are greedy only: skipped at --temperature > 0")
    elif settings.llamacpp:
        try:
            methods += llamacpp_methods(gguf, torch.get_num_threads(), loaded.eos_token_ids)
            llamacpp_note = f"{gguf}, n_threads {torch.get_num_threads()}"
        except LlamaCppMissing as e:
            llamacpp_note = f"skipped: {e}"
            note(str(e))
    curve_peers = {}
    ran = llamacpp_note is not None and not llamacpp_note.startswith("skipped")
    if settings.verify_curve and settings.llamacpp and ran:
        curve_peers["llama.cpp"] = llamacpp_verify_forward(gguf, torch.get_num_threads(), CURVE_MAX_K)
    return llamacpp_note, curve_peers


def measure(
    settings: BenchSettings,
    planned: BenchPlan,
    run: BenchRun,
    on_curve_step: Callable[[], None] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """The verify-cost curve (--verify-curve: ``curve_repeats`` + 1 steps), then every question through every
    method (``on_progress`` after each)."""
    from .runner import run_bench
    from .verify_curve import measure_verify_curves

    loaded = run.first_target
    verify_cost = curves = None
    if settings.verify_curve:
        curves = measure_verify_curves(
            loaded, CURVE_MAX_K, CURVE_CONTEXT, settings.curve_repeats, on_step=on_curve_step, peers=run.curve_peers
        )
        verify_cost = curves.relative()
    result = run_bench(loaded, planned.items, run.methods, run.config, verify_cost, on_progress=on_progress)
    result.verify_milliseconds = None if curves is None else curves.milliseconds
    return result


def setup_of(settings: BenchSettings, planned: BenchPlan, run: BenchRun) -> dict[str, Any]:
    """What the report records of the run's setup."""
    return {
        "target": settings.target,
        "dtype": settings.dtype,
        "draft": settings.draft,
        "prompts": str(settings.prompts) if settings.prompts is not None else "built-in default set",
        "categories": settings.categories,
        "limit": settings.limit,
        "proposers": planned.proposers,
        "gammas": planned.gammas,
        "modes": planned.modes,
        "quantization": planned.settings,
        "weights": {q: t.quantization for q, t in run.targets.items()},
        "llamacpp": run.llamacpp_note,
    }
