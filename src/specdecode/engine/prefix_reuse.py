"""Reusing a runner's KV cache across requests: what a finished request leaves in its runner, and how much of
it a new prompt keeps (``SpeculativeDecoder``'s chat reuse; the server copies whole blocks of it,
``serving.batching.prefix_cache``).

Sound only on a runner whose prefill stores what one-token steps store (``exact_prefix_reuse``: the native
runner), so that a kept prefix plus a prefill of the rest is bitwise the cache a full prefill builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.runner import ModelRunner
from ..proposers.base import common_prefix_length
from .request import Request


@dataclass
class HeldPrefix:
    """The tokens whose entries a runner holds, in position order, and (a runner that captures them) their
    target features."""

    tokens: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None


def held_after(request: Request, runner: ModelRunner) -> HeldPrefix:
    """What ``runner`` holds once ``request`` is over: a prefix of its context (every token but the newest, or
    fewer; the runner is rolled back to it) and, if the runner captures them, those positions' features."""
    held = min(runner.length, len(request.context) - 1)
    hidden = None
    if runner.capture_hidden and request.target_hidden:
        hidden = torch.cat(request.target_hidden)[:held]
        held = min(held, hidden.shape[0])
    runner.rollback_to(held)
    return HeldPrefix(request.context[:held], hidden)


def reusable_length(runner: ModelRunner, held: HeldPrefix, context: list[int]) -> int:
    """How many of ``context``'s first tokens ``runner`` may keep from ``held``: their longest common prefix, at
    most every token but the last (it leads the first round); 0 on a runner without ``exact_prefix_reuse``,
    one that holds something else, or one that captures features ``held`` lacks."""
    if not runner.exact_prefix_reuse or runner.length != len(held.tokens):
        return 0
    cached = min(common_prefix_length(held.tokens, context), len(context) - 1)
    if runner.capture_hidden:
        cached = min(cached, 0 if held.hidden is None else held.hidden.shape[0])
    return cached
