"""Self-speculation: the target's first N layers (+ final norm + LM head) as its own draft model."""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..models.loader import LoadedModel
from .draft_model import DraftModelProposer


def truncated_model(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """A view of ``loaded`` that runs only its first ``num_layers`` decoder layers, sharing every weight."""
    model = loaded.model
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"self-speculation needs a decoder with .model.layers; {type(model).__name__} has none")
    total = len(layers)
    if not 1 <= num_layers < total:
        raise ValueError(f"self:N needs 1 <= N < {total} (the target's layer count), got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    new_inner = copy.copy(inner)
    new_inner._modules = dict(inner._modules)
    new_inner.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    new_inner.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft.model = new_inner
    draft.config = config
    return dataclasses.replace(loaded, model=draft, name=f"{loaded.name}[:{num_layers}]")


class LayerSkipProposer(DraftModelProposer):
    """Draft with the target's own first ``num_layers`` layers (an untrained early exit: a stand-in)."""

    def __init__(self, target: LoadedModel, num_layers: int) -> None:
        super().__init__(truncated_model(target, num_layers))
