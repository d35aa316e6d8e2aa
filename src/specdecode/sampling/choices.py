"""The random decisions of exact speculative decoding, behind one small interface.

Every random step of the exact rules (``verify``) and of the proposers that sample (``probs.sample``, EAGLE's
draws without replacement) is one of: accept a run of guesses (each with probability min(1, ratio)), accept one
guess, draw a token from a distribution, draw distinct tokens in order. ``GeneratorChoices`` makes them with a
``torch.Generator`` — a uniform u, accepted iff u < ratio; a token by inverting the cumulative distribution at
a uniform (``inverse_cdf``) — and is what a plain generator means everywhere. ``exactness.enumerate_law`` passes
an enumerator instead, which takes every branch in turn with its exact probability, so the engine's output law
can be computed rather than sampled.

The decisions also say which token they emit (``token`` / ``tokens``): an enumerator stops a run as soon as the
tokens it is asked about are decided.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Choices(Protocol):
    def accept_run(self, ratios: torch.Tensor, tokens: list[int]) -> int:
        """How many of the guesses ``tokens`` are accepted in a row, guess i with probability
        min(1, ``ratios[i]``) (float64 ``[k]``) given the earlier ones."""

    def accept(self, ratio: float, token: int) -> bool:
        """Accept the guess ``token`` with probability min(1, ``ratio``)."""

    def draw(self, probs: torch.Tensor, emitted: bool = True) -> int:
        """A token from ``probs`` (``[V]``, any positive mass); ``emitted``: the token is output (not a guess)."""

    def draw_distinct(self, probs: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` distinct tokens drawn in order from ``probs``, each from the renormalised rest."""


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` (``[..., V]``, any non-negative mass, not all zero) the index i with
    C(i−1) ≤ u·C(V−1) < C(i), C the row's cumulative sums in float64 and u its entry of ``uniforms`` (``[...]``,
    in [0, 1)): for u ~ U[0, 1) a draw from the normalised row, exact to float64 rounding. A zero-mass entry is
    never drawn (its C equals its predecessor's). On the CPU kernels (float32 or float64 rows) C is summed in
    fixed blocks and the row is read about twice, ~25 µs for V = 49,152 here; ``inverse_cdf_torch`` (~90 µs)
    runs elsewhere. ``torch.multinomial`` takes ~780 µs (it draws one exponential per entry)."""
    kernels = _sampling_kernels(probs)
    if kernels is None:
        return inverse_cdf_torch(probs, uniforms)
    drawn = kernels.inverse_cdf_rows(probs.reshape(-1, probs.shape[-1]), uniforms.double().reshape(-1))
    if bool((drawn < 0).any()):
        raise ValueError(NO_MASS)
    return drawn.reshape(probs.shape[:-1])


NO_MASS = "cannot draw from a distribution with no positive, finite mass (NaN or inf in it?)"


def inverse_cdf_torch(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``inverse_cdf`` in torch ops (C a float64 ``cumsum``): any device, and the reference the kernel is tested
    against."""
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError(NO_MASS)
    index = torch.searchsorted(cdf, uniforms.double().unsqueeze(-1) * total, right=True).squeeze(-1)
    past_end = index >= probs.shape[-1]  # u·C rounded up to C itself: the last entry with mass
    if bool(past_end.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int64).argmax(-1)
        index = torch.where(past_end, last, index)
    return index


def _sampling_kernels(probs: torch.Tensor):
    """The CPU kernels' operators when they can draw from ``probs`` (float32 / float64 on the CPU), else None."""
    if probs.device.type != "cpu" or probs.dtype not in (torch.float32, torch.float64) or probs.shape[-1] == 0:
        return None
    from ..kernels import ops

    return ops()


# A chain rule as a deterministic function of its uniforms: (accept_u [k] float64, draw_u) -> (n accepted, token)
ChainRule = Callable[[torch.Tensor, float], Sequence[int]]


class UniformsChoices:
    """``Choices`` that can also drive a rule given as a function of explicit uniforms (the compiled ``exact_chain``):
    a generator feeds it its own uniforms, an enumerator (``enumeration.KernelEnumerator``) bisects them, so what is
    sampled and what is enumerated is the same compiled code."""

    def chain(self, rule: ChainRule, tokens: list[int]) -> tuple[int, int]:
        """``rule``'s (n accepted, next token) for the guesses ``tokens``: guess i accepted iff accept_u[i] < its
        ratio, the token a function of n and draw_u only."""
        raise NotImplementedError


class GeneratorChoices(UniformsChoices):
    """The decisions made with a ``torch.Generator``: float64 uniforms (accept iff u < ratio, strict, so a ratio
    of 0 never passes) and ``inverse_cdf`` at one uniform per token drawn."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def chain(self, rule: ChainRule, tokens: list[int]) -> tuple[int, int]:
        accept_u = torch.rand(len(tokens), dtype=torch.float64, generator=self.generator)
        draw_u = float(torch.rand((), dtype=torch.float64, generator=self.generator))
        n_accepted, token = rule(accept_u, draw_u)
        return int(n_accepted), int(token)

    def accept_run(self, ratios: torch.Tensor, tokens: list[int]) -> int:
        u = torch.rand(len(ratios), dtype=torch.float64, generator=self.generator)
        rejected = torch.nonzero(~(u < ratios))
        return int(rejected[0, 0]) if rejected.numel() else len(ratios)

    def accept(self, ratio: float, token: int) -> bool:
        return float(torch.rand((), dtype=torch.float64, generator=self.generator)) < ratio

    def draw(self, probs: torch.Tensor, emitted: bool = True) -> int:
        return int(inverse_cdf(probs, torch.rand((), dtype=torch.float64, generator=self.generator)))

    def draw_distinct(self, probs: torch.Tensor, count: int) -> torch.Tensor:
        if count == 1:  # a chain's one child: no copy to remove it from
            return torch.tensor([self.draw(probs, emitted=False)], dtype=torch.int64)
        rest = probs.double().clone()
        drawn = []
        for _ in range(count):  # each draw from the renormalised rest: the drawn token's mass removed
            drawn.append(self.draw(rest, emitted=False))
            rest[drawn[-1]] = 0.0
        return torch.tensor(drawn, dtype=torch.int64)


def as_choices(source: torch.Generator | Choices) -> Choices:
    """``source`` itself if it makes the decisions, else ``GeneratorChoices`` over the generator."""
    return GeneratorChoices(source) if isinstance(source, torch.Generator) else source
