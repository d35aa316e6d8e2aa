"""One target pass for several requests: each with its own KV cache, over the same weights."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .native.runner import NativeLlamaRunner
from .native.runner import forward_batch as _native_forward_batch
from .runner import ModelRunner


def forward_batch(runners: Sequence[ModelRunner], tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Append ``tokens[i]`` (int64 ``[k_i]``, a chain) to ``runners[i]``; return each one's logits ``[k_i, V]``.

    Native runners over one model run all rows in one pass through the weights (bitwise each runner's own
    ``forward``: row invariance); any other runners run one ``forward`` each.
    """
    if len(runners) != len(tokens):
        raise ValueError(f"forward_batch got {len(runners)} runners but {len(tokens)} token chunks")
    if not runners:
        return []
    if all(isinstance(r, NativeLlamaRunner) for r in runners) and len(runners) > 1:
        return _native_forward_batch(runners, tokens)
    return [runner.forward(chunk) for runner, chunk in zip(runners, tokens, strict=True)]
