"""Gumbel noise keyed by (seed, position): the randomness shared by plain and reproducible decoding.

The noise at absolute context position t is a function of (seed, t) alone: V float64 uniforms from Philox4x64
(a counter-based generator, Salmon et al. 2011) whose 128-bit key is the pair (t, seed). It does not depend on
how many random numbers earlier positions consumed, nor on which path (plain or speculative) reaches t.

Gumbel-max: with g_x i.i.d. standard Gumbel, P(argmax_x (ℓ_x + g_x) = y) = softmax(ℓ)_y. Tokens warped away
(ℓ_x = −inf) are never chosen, so argmax(warp(logits) + g) is a draw from the request's warped distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .params import SamplingParams
from .sampling import warp_logits


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``−log(−log u)`` ``[V]``, u ~ U[0, 1)^V from Philox keyed by (position, seed)."""
    key = (position << 64) | seed
    uniforms = np.random.Generator(np.random.Philox(key=key)).random(vocab_size)
    return -torch.log(-torch.log(torch.from_numpy(uniforms)))


def gumbel_max(logits: torch.Tensor, params: SamplingParams, seed: int, start: int) -> torch.Tensor:
    """Token per row r of ``logits`` ``[n, V]``: argmax(warp(logits_r) + g(seed, start + r)); argmax if greedy."""
    if params.greedy:
        return logits.argmax(dim=-1)
    warped = warp_logits(logits, params.temperature, params.top_k, params.top_p).double()
    noise = torch.stack([gumbel_noise(seed, start + r, logits.shape[-1]) for r in range(logits.shape[0])])
    return (warped + noise).argmax(dim=-1)


@dataclass(frozen=True)
class KeyedNoise:
    """A request's keyed sampler: the token at position t is a function of (seed, t, logits) only."""

    seed: int

    def tokens(self, logits: torch.Tensor, params: SamplingParams, start: int) -> torch.Tensor:
        """Gumbel-max tokens ``[n]`` for ``logits`` ``[n, V]`` predicting positions start .. start+n−1."""
        return gumbel_max(logits, params, self.seed, start)

    def token(self, logits: torch.Tensor, params: SamplingParams, position: int) -> int:
        """The Gumbel-max token at ``position`` for one row of ``logits`` ``[V]``."""
        return int(gumbel_max(logits[None], params, self.seed, position)[0])
