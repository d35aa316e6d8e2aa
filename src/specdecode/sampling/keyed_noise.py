"""Gumbel noise keyed by (seed, position): the randomness shared by plain and reproducible decoding.

The noise at absolute context position t is a function of (seed, t) alone: V float64 uniforms from Philox4x64
(a counter-based generator, Salmon et al. 2011) whose 128-bit key is the pair (t, seed). It does not depend on
how many random numbers earlier positions consumed, nor on which path (plain or speculative) reaches t.

Gumbel-max: with g_x i.i.d. standard Gumbel (CDF F(z) = exp(−e^{−z})), argmax_x (ℓ_x + g_x) ~ softmax(ℓ):
P(argmax = y) = ∫ e^{−g} e^{−e^{−g}} Π_{x≠y} F(ℓ_y + g − ℓ_x) dg = ∫ e^{−g} exp(−e^{−g} Σ_x e^{ℓ_x−ℓ_y}) dg
= e^{ℓ_y} / Σ_x e^{ℓ_x}. Tokens warped away (ℓ_x = −inf) are never chosen, so argmax(warp(logits) + g) is a
draw from the request's warped distribution (float64 sums; float32 warped logits).

Why reproducible speculative decoding is plain sampling, token for token. Plain decoding emits at position t
the token T_t(c) = argmax(warp(target(c)) + g(seed, t)), c the context before t. A speculative round at
context c (|c| = t) scores c + d[:i] for i = 0..k in one pass and computes target_i = T_{t+i}(c + d[:i]);
``verify.coupled_verify`` accepts d_i while d_i = target_i and then emits target_n. By induction on i, every
accepted d[:i] equals plain decoding's tokens at t..t+i−1, so c + d[:i] is plain decoding's context at t+i and
target_i is plain decoding's token there; the emitted target_n is too. So the outputs agree whatever the
draft proposes (its guesses change only how many tokens a pass yields), given equal target logits (the
same numerics on both paths: test it in float32).
A token tree works the same way: the row of a node at depth d scores its branch c + (path to the node) and
predicts position t + d, so its token is computed with g(seed, t + d) (``KeyedNoise.tokens_at``), and
``verify.tree_coupled_verify`` follows the child equal to it; the induction runs along the accepted path.

Why each token has the target's law. The keys (t, seed) differ for every position, so g(seed, t) is fresh
noise, independent of the context at t (a function of g at earlier positions only); by Gumbel-max the token
at t given the past is distributed as softmax(warp(target(c))). A fixed seed fixes the output; a random seed
makes it a sample of the target's warped autoregressive law, the same law as exact mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .params import SamplingParams
from .probs import greedy_tokens, warp

LN2 = 0.6931471805599453


def philox_uniforms(seed: int, position: int, count: int) -> np.ndarray:
    """The noise's uniforms ``[count]`` float64 in [0, 1): Philox keyed by (position, seed), numpy's stream."""
    return np.random.Generator(np.random.Philox(key=(position << 64) | seed)).random(count)


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``−log(−log u)`` ``[V]``, u = ``philox_uniforms(seed, position, V)``."""
    return -torch.log(-torch.log(torch.from_numpy(philox_uniforms(seed, position, vocab_size))))


def gumbel_max(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    start: int = 0,
    *,
    positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """Token per row r of ``logits`` ``[n, V]``: argmax(warp(logits_r) + g(seed, t_r)); argmax if greedy.

    t_r = start + r (a chain), or ``positions[r]`` (a token tree: each row predicts its own depth's position).
    Computed by ``keyed_argmax`` (the CPU kernel's, or the same function in numpy where the kernels are off).
    """
    if params.greedy:
        return greedy_tokens(logits)
    if positions is None:
        positions = range(start, start + logits.shape[0])
    warped = warp(logits, params).double().cpu()
    return keyed_argmax(warped, seed, [int(t) for t in positions])


def keyed_argmax(warped: torch.Tensor, seed: int, positions: list[int]) -> torch.Tensor:
    """argmax_x (warped[r, x] + g_x) per row r, g = ``gumbel_noise(seed, positions[r], V)``, ties to the lowest x.

    Exact, with few logarithms: with m = argmax_x warped[r, x] and best0 = warped[r, m] + g_m, a token x can win
    only if warped[r, x] − log E_x ≥ best0 with E_x = −log u_x ≥ 1 − u_x = f·2^e (f ∈ [1/2, 1)), so only if
    (e − 1)·ln 2 ≤ warped[r, x] − best0 (+ a relative slack of 1e-9 for rounding): the rest never need g_x.
    The survivors' g_x use the C library's log (``math.log``), as the kernel does, so the kernel and this numpy
    path choose the same token bitwise. The kernel also draws Philox in C, parallel over the vocabulary: 0.1 ms
    a row of 49,152 instead of 0.4 ms (docs/BENCHMARKS.md).
    """
    from ..kernels import ops

    kernels = ops()
    if kernels is not None:
        return kernels.keyed_gumbel_argmax(warped.contiguous(), seed, positions)
    rows = warped.numpy()
    return torch.tensor([_keyed_argmax_row(rows[r], seed, t) for r, t in enumerate(positions)], dtype=torch.int64)


def _gumbel(u: float) -> float:
    return -math.inf if u == 0.0 else -math.log(-math.log(u))


def _keyed_argmax_row(row: np.ndarray, seed: int, position: int) -> int:
    """``keyed_argmax`` for one row, in numpy (the kernel's operations in the same order)."""
    u = philox_uniforms(seed, position, len(row))
    m = int(np.argmax(row))
    best0 = float(row[m]) + _gumbel(float(u[m]))
    slack = 1e-9 * (1.0 + abs(best0))
    _, exponent = np.frexp(1.0 - u)
    with np.errstate(invalid="ignore"):
        survivors = (exponent - 1).astype(np.float64) * LN2 <= (row - best0) + slack
    survivors[m] = True
    best, chosen = -math.inf, -1
    for x in np.flatnonzero(survivors).tolist():
        value = float(row[x]) + _gumbel(float(u[x]))
        if chosen < 0 or value > best:
            best, chosen = value, x
    return chosen


@dataclass(frozen=True)
class KeyedNoise:
    """A request's keyed sampler: the token at position t is a function of (seed, t, logits) only."""

    seed: int

    def tokens(self, logits: torch.Tensor, params: SamplingParams, start: int) -> torch.Tensor:
        """Gumbel-max tokens ``[n]`` for ``logits`` ``[n, V]`` predicting positions start .. start+n−1."""
        return gumbel_max(logits, params, self.seed, start)

    def tokens_at(self, logits: torch.Tensor, params: SamplingParams, positions: Sequence[int]) -> torch.Tensor:
        """Gumbel-max tokens ``[n]`` for ``logits`` ``[n, V]``, row r predicting position ``positions[r]``."""
        return gumbel_max(logits, params, self.seed, positions=positions)

    def token(self, logits: torch.Tensor, params: SamplingParams, position: int) -> int:
        """The Gumbel-max token at ``position`` for one row of ``logits`` ``[V]``."""
        return int(gumbel_max(logits[None], params, self.seed, position)[0])
