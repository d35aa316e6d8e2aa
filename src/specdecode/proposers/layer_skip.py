"""Self-speculation: the target with some of its decoder layers skipped (+ final norm + LM head) as its own draft.

``self:N`` keeps the first N layers (an early exit); a skip set (``skip:SKIP.json`` from ``tune-skip``, or
``skip:3,5,9-12``) drops any layers, as SWIFT and Draft & Verify do. Either way the draft is a view that shares
every weight with the target and keeps its own KV cache (the kept layers' keys differ from the target's once a
skipped layer precedes them, so they are not shared).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..models.loaded import LoadedModel
from .draft_model import DraftModelProposer

SKIP_SET_FORMAT = "specdecode-skip-set/1"


@dataclasses.dataclass(frozen=True)
class SkipSet:
    """Which of a target's ``layers`` decoder layers a self-draft skips, and what the search measured."""

    target: str
    layers: int
    skip: tuple[int, ...]
    search: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.layers < 2:
            raise ValueError(f"a skip set needs a target with at least 2 layers, got {self.layers}")
        skip = tuple(sorted(set(self.skip)))
        if skip != tuple(self.skip):
            raise ValueError(f"skipped layers must be distinct and ascending, got {list(self.skip)}")
        if any(not 0 <= i < self.layers for i in skip):
            raise ValueError(f"skipped layers must be in 0..{self.layers - 1}, got {list(skip)}")
        if not 1 <= len(skip) < self.layers:
            raise ValueError(f"a skip set must skip between 1 and {self.layers - 1} of {self.layers} layers")

    @property
    def kept(self) -> tuple[int, ...]:
        """The layers the draft runs, in order."""
        return tuple(i for i in range(self.layers) if i not in set(self.skip))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SKIP_SET_FORMAT,
            "target": self.target,
            "layers": self.layers,
            "skip": list(self.skip),
            "search": self.search,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SkipSet:
        """Read a skip set written by ``save`` (``tune-skip --out``); a clear error for anything else."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"skip set not found: {path} (write one with specdecode tune-skip)")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a skip set (not JSON: {e})") from None
        if not isinstance(data, dict) or data.get("format") != SKIP_SET_FORMAT:
            raise ValueError(f'{path} is not a skip set (no "format": "{SKIP_SET_FORMAT}")')
        try:
            return cls(str(data["target"]), int(data["layers"]), tuple(int(i) for i in data["skip"]),
                       dict(data.get("search") or {}))  # fmt: skip
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a skip set (missing or bad field {e})") from None


def parse_layer_list(text: str, layers: int) -> tuple[int, ...]:
    """``"3,5,9-12"`` → (3, 5, 9, 10, 11, 12), checked against a ``layers``-layer target."""
    picked: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"skip:LIST takes layer numbers and ranges like 3,5,9-12; got {text!r}")
        picked.update(range(int(first), int(last or first) + 1))
    return SkipSet("", layers, tuple(sorted(picked))).skip


def layer_count(loaded: LoadedModel) -> int:
    """The number of decoder layers of ``loaded`` (``.model.layers``); a clear error for other models."""
    layers = getattr(getattr(loaded.model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"self-speculation needs a decoder with .model.layers; {type(loaded.model).__name__} has none")
    return len(layers)


def kept_layers_model(loaded: LoadedModel, kept: Sequence[int], label: str) -> LoadedModel:
    """A view of ``loaded`` that runs only its decoder layers ``kept`` (ascending), sharing every weight.

    The native runner takes the layer modules as they are (its fused weights are cached per module, so the
    view shares them); transformers' runner indexes its cache by ``self_attn.layer_idx``, so for it each kept
    layer is a shallow copy (same parameters) renumbered 0..len(kept)-1.
    """
    model = loaded.model
    inner = model.model
    layers = list(inner.layers)
    kept = list(kept)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in kept]
    chosen = [layers[i] for i in kept]
    if loaded.backend != "native" and kept != list(range(len(kept))):
        chosen = [_renumbered(layer, j) for j, layer in enumerate(chosen)]
    new_inner = copy.copy(inner)
    new_inner._modules = dict(inner._modules)
    new_inner.layers = torch.nn.ModuleList(chosen)
    new_inner.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft.model = new_inner
    draft.config = config
    return dataclasses.replace(loaded, model=draft, name=f"{loaded.name}[{label}]")


def for_transformers(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` with its decoder layers numbered 0..n-1, as transformers' own ``generate`` indexes its cache
    (a native view of a skip set keeps the target's layer modules, numbered as in the target)."""
    layers = list(loaded.model.model.layers)
    if all(layer.self_attn.layer_idx == j for j, layer in enumerate(layers)):
        return loaded
    inner = copy.copy(loaded.model.model)
    inner._modules = dict(inner._modules)
    inner.layers = torch.nn.ModuleList([_renumbered(layer, j) for j, layer in enumerate(layers)])
    model = copy.copy(loaded.model)
    model._modules = dict(model._modules)
    model.model = inner
    return dataclasses.replace(loaded, model=model)


def _renumbered(layer: torch.nn.Module, index: int) -> torch.nn.Module:
    """A shallow copy of a decoder layer (same parameters) whose attention writes cache layer ``index``."""
    attn = copy.copy(layer.self_attn)
    attn.layer_idx = index
    clone = copy.copy(layer)
    clone._modules = dict(layer._modules)
    clone.self_attn = attn
    return clone


def truncated_model(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """A view of ``loaded`` that runs only its first ``num_layers`` decoder layers, sharing every weight."""
    total = layer_count(loaded)
    if not 1 <= num_layers < total:
        raise ValueError(f"self:N needs 1 <= N < {total} (the target's layer count), got {num_layers}")
    return kept_layers_model(loaded, range(num_layers), f":{num_layers}")


def skipping_model(loaded: LoadedModel, skip: SkipSet | Sequence[int]) -> LoadedModel:
    """A view of ``loaded`` without the layers in ``skip`` (a ``SkipSet`` must be for this target's depth)."""
    total = layer_count(loaded)
    if isinstance(skip, SkipSet):
        if skip.layers != total:
            raise ValueError(
                f"this skip set is for a {skip.layers}-layer target ({skip.target or 'unnamed'}); "
                f"{loaded.name} has {total} layers"
            )
        skip_set = skip
    else:
        skip_set = SkipSet(loaded.name, total, tuple(sorted(set(int(i) for i in skip))))
    return kept_layers_model(loaded, skip_set.kept, "-" + ",".join(map(str, skip_set.skip)))


def self_draft_model(target: LoadedModel, draft: str) -> LoadedModel | None:
    """The view a ``--draft`` word names: ``self:N``, ``skip:FILE.json`` or ``skip:3,5,9-12``; None for others."""
    if draft.startswith("self:"):
        layers = draft.removeprefix("self:")
        if not layers.isdigit():
            raise ValueError(f"--draft self:N needs an integer layer count, got {draft!r}")
        return truncated_model(target, int(layers))
    if draft.startswith("skip:"):
        spec = draft.removeprefix("skip:")
        if spec.endswith(".json") or Path(spec).expanduser().is_file():
            return skipping_model(target, SkipSet.load(spec))
        return skipping_model(target, parse_layer_list(spec, layer_count(target)))
    return None


class LayerSkipProposer(DraftModelProposer):
    """Draft with the target's own layers: the first ``num_layers`` (an untrained early exit), or all but the
    layers in ``skip`` (a ``SkipSet`` or layer indices, e.g. one ``tune-skip`` chose)."""

    def __init__(
        self, target: LoadedModel, num_layers: int | None = None, *, skip: SkipSet | Sequence[int] | None = None
    ) -> None:
        if (num_layers is None) == (skip is None):
            raise ValueError("LayerSkipProposer takes num_layers (the first N layers) or skip (layers to drop)")
        model = truncated_model(target, num_layers) if skip is None else skipping_model(target, skip)
        super().__init__(model, vocabulary=None)  # the target's own head: a cut copy would add to its memory
