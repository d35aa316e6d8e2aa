"""The sampling maths: a request's settings (``params``), the warps of the target's logits (``warps``, ``probs``),
drawing from a distribution (``choices``, ``keyed_noise``), drafts and token trees (``draft``, ``tree``) and the
acceptance rules (``verify``). Pure functions over tensors: they may call the compiled kernels, never a model."""

from .probs import greedy_tokens, probs_from_logits, sample, warp, warp_logits

__all__ = ["greedy_tokens", "probs_from_logits", "sample", "warp", "warp_logits"]
