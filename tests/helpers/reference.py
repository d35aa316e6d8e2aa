"""transformers' own forward, the reference the runners are compared against."""

from __future__ import annotations

import torch


def no_cache_logits(model: torch.nn.Module, ids) -> torch.Tensor:
    """Float32 logits ``[len(ids), V]`` of one full-sequence forward without a cache (the model's own attention,
    sliding windows included); ``ids`` a list or a 1-D tensor."""
    with torch.no_grad():
        return model(torch.as_tensor(ids)[None], use_cache=False).logits[0].float()
