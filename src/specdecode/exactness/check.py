"""Is speculative decoding exact? Sample the first K tokens many times and test them against the target's law.

The reference laws are computed, not sampled: for K = 1 the target's warped distribution after the prompt;
for K = 2 the joint p(x1) p(x2 | x1) over the ``cap`` most probable first tokens (one target pass each), with
every other first token pooled into one cell (its mass is exact: 1 − Σ p(x1) over the enumerated ones). A
first token that ends generation (EOS) pairs with an "end" cell.

Each law is tested with Pearson's chi-square after pooling the cells whose expected count is below 5 (the
pooling depends on the law and N only, never on the data), Bonferroni-corrected over prompts × K so that
``alpha`` is the family's false-alarm rate. A token the law gives probability 0 is a violation on its own.
The total-variation distance over the test's cells is reported with its expectation under exactness (the
empirical TV is biased upward) and a 1 − δ upper bound on the true TV (see ``tv_upper_bound``), and each test's
power is stated: the smallest TV it detects with probability 0.9 whatever the biased law (``detectable_tv``);
``samples_for_tv`` inverts it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..engine.decoder import SpeculativeDecoder
from ..errors import optional_import
from ..models.loaded import LoadedModel
from ..proposers.base import Proposer
from ..sampling.params import SamplingParams
from ..sampling.probs import greedy_tokens, warp

brentq = optional_import("scipy.optimize", "bench", "check-exact's statistics").brentq
_stats = optional_import("scipy.stats", "bench", "check-exact's statistics")
chi2, ncx2 = _stats.chi2, _stats.ncx2

MIN_EXPECTED = 5.0
NULL_REPLICATES = 200


def target_law(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's warped distribution (float64) for one row of ``logits``; one-hot argmax if greedy."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits.unsqueeze(0))[0], logits.shape[-1]).double()
    return torch.softmax(warp(logits, params).double(), dim=-1)


@dataclass(frozen=True)
class PairLaw:
    """Joint law of (x1, x2) over cells: rank r of x1 in ``first`` × (x2 or "end" = V), plus one pooled cell.

    ``probs[r * (V + 1) + x2]`` = p(first[r]) p(x2 | first[r]); the last cell holds p(x1 ∉ first).
    """

    first: tuple[int, ...]
    vocab_size: int
    probs: torch.Tensor

    def cell(self, tokens: Sequence[int]) -> int:
        """The cell of a sampled prefix (one token if generation ended after it)."""
        rank = {token: r for r, token in enumerate(self.first)}.get(tokens[0])
        if rank is None:
            return len(self.probs) - 1
        return rank * (self.vocab_size + 1) + (tokens[1] if len(tokens) > 1 else self.vocab_size)


def first_token_law(target: LoadedModel, prompt_ids: list[int], params: SamplingParams) -> torch.Tensor:
    """p(x1 | prompt) ``[V]`` float64."""
    runner = target.new_runner()
    return target_law(runner.forward(torch.tensor(prompt_ids, dtype=torch.int64))[-1], params)


def pair_law(target: LoadedModel, prompt_ids: list[int], params: SamplingParams, cap: int = 64) -> PairLaw:
    """The exact joint of the first two tokens over the ``cap`` most probable first tokens, the rest pooled."""
    runner = target.new_runner()
    first_probs = target_law(runner.forward(torch.tensor(prompt_ids, dtype=torch.int64))[-1], params)
    support = int((first_probs > 0).sum())
    first = torch.sort(first_probs, descending=True, stable=True).indices[: min(cap, support)]
    vocab = first_probs.shape[0]
    probs = torch.zeros(len(first) * (vocab + 1) + 1, dtype=torch.float64)
    for r, token in enumerate(first.tolist()):
        row = probs[r * (vocab + 1) : (r + 1) * (vocab + 1)]
        if token in target.eos_token_ids:
            row[vocab] = first_probs[token]
            continue
        runner.rollback_to(len(prompt_ids))
        row[:vocab] = first_probs[token] * target_law(runner.forward(torch.tensor([token]))[0], params)
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[first] = False
    probs[-1] = first_probs[rest].sum()
    return PairLaw(tuple(first.tolist()), vocab, probs)


def pool_cells(probs: torch.Tensor, samples: int, min_expected: float = MIN_EXPECTED) -> torch.Tensor:
    """Group id per cell: cells with expected count ≥ min_expected alone, the others pooled; −1 for p = 0.

    If the pooled group is still below ``min_expected`` it joins the smallest well-filled cell.
    """
    expected = probs * samples
    groups = torch.full(probs.shape, -1, dtype=torch.int64)
    big = torch.nonzero(expected >= min_expected).flatten()
    groups[big] = torch.arange(len(big))
    small = (expected < min_expected) & (probs > 0)
    if small.any():
        if expected[small].sum() >= min_expected or not len(big):
            groups[small] = len(big)
        else:
            groups[small] = groups[big[expected[big].argmin()]]
    return groups


def pooled_shape(probs: torch.Tensor, samples: int) -> tuple[int, float]:
    """(degrees of freedom, hidden TV) of the chi-square test of ``probs`` at ``samples`` draws after
    ``pool_cells``: the cells kept minus one, and Σ over the groups of several cells of their mass m less their
    smallest cell's p_min — the TV a law moves unseen by putting all of m on that cell (½((m − p_min) + (m − p_min)),
    the most any law keeping the group's mass can move: three cells of 0.01 hide 0.02)."""
    groups = pool_cells(probs, samples)
    kept = groups >= 0
    if not kept.any():
        return 0, 0.0
    hidden = 0.0
    for group in torch.unique(groups[kept]).tolist():
        cells = probs[groups == group].double()
        if len(cells) > 1:
            hidden += float(cells.sum() - cells.min())
    return int(groups.max()), hidden


def tv_upper_bound(tv: float, cells: int, samples: int, delta: float) -> float:
    """1 − δ bound on TV(q, p) over ``cells`` cells: TV(p̂, p) + ½√((C−1)/N) + √(ln(1/δ) / 2N).

    TV(q, p) ≤ TV(p̂, p) + TV(p̂, q); E TV(p̂, q) ≤ ½ Σ √(q_i(1−q_i)/N) ≤ ½√((C−1)/N) (Cauchy–Schwarz), and
    TV(p̂, q) moves by at most 1/N per sample, so McDiarmid bounds its excess over the mean.
    """
    return min(1.0, tv + 0.5 * math.sqrt(max(cells - 1, 0) / samples) + math.sqrt(math.log(1 / delta) / (2 * samples)))


POWER = 0.9


def _noncentrality(dof: int, threshold: float, power: float) -> float:
    """λ* with P(χ²_dof(λ*) > the level-``threshold`` critical value) = ``power``."""
    critical = chi2.isf(threshold, dof)
    return float(brentq(lambda lam: ncx2.sf(critical, dof, lam) - power, 1e-9, 1e7))


def detectable_tv(samples: int, dof: int, threshold: float, power: float = POWER, hidden: float = 0.0) -> float:
    """The smallest TV(q, p) that the level-``threshold`` chi-square test on ``samples`` draws detects with
    probability ≥ ``power`` for every biased law q.

    Under q, Pearson's statistic is approximately noncentral χ²_dof(λ), λ = N Σ (q − p)²/p. By Cauchy–Schwarz
    (Σ|q − p|)² ≤ Σ (q − p)²/p · Σ p, so λ ≥ 4 N TV² (equal for q − p = ±2 TV · p on two halves of p's mass):
    every q with TV ≥ √(λ*/4N) is detected with probability ≥ ``power``. ``hidden``: the TV a law can move inside
    the pooled cells, unseen (``pooled_shape``: per group its mass less its smallest cell), added on top.
    """
    if dof < 1:
        return 1.0
    return min(1.0, math.sqrt(_noncentrality(dof, threshold, power) / (4 * samples)) + hidden)


def samples_for_tv(tv: float, dof: int, threshold: float, power: float = POWER) -> int:
    """Draws the chi-square test needs to detect every law at TV ≥ ``tv`` with probability ``power``."""
    return math.ceil(_noncentrality(dof, threshold, power) / (4 * tv * tv))


def null_tv(probs: torch.Tensor, samples: int, generator: torch.Generator, replicates: int = NULL_REPLICATES) -> float:
    """E TV(p̂, p) when the N samples really come from p (Monte Carlo): the empirical TV's bias."""
    draws = torch.multinomial(probs.float(), samples * replicates, replacement=True, generator=generator)
    counts = torch.zeros(replicates, len(probs), dtype=torch.float64)
    counts.scatter_add_(1, draws.view(replicates, samples), torch.ones(replicates, samples, dtype=torch.float64))
    return float(0.5 * (counts / samples - probs).abs().sum(dim=1).mean())


@dataclass(frozen=True)
class FitTest:
    """One prompt × K: Pearson chi-square of the sampled prefixes against the target's exact law."""

    prompt_index: int
    k: int
    samples: int
    cells: int
    statistic: float
    dof: int
    p_value: float
    impossible: int
    tv: float
    tv_null: float
    tv_upper: float
    threshold: float
    hidden_tv: float = 0.0  # the TV a law could move inside the pooled cells (per group: its mass − its smallest cell)

    @property
    def detectable_tv(self) -> float:
        """Every law at least this far from the target (TV) fails this test with probability ≥ 0.9."""
        return detectable_tv(self.samples, self.dof, self.threshold, POWER, self.hidden_tv)

    @property
    def rejected(self) -> bool:
        """Exactness rejected: a probability-0 prefix was seen or p < the Bonferroni threshold."""
        return self.impossible > 0 or self.p_value < self.threshold

    @property
    def verdict(self) -> str:
        """One line a person can read."""
        word = "BIASED" if self.rejected else "consistent"
        extra = f", {self.impossible} impossible" if self.impossible else ""
        return (
            f"prompt {self.prompt_index} K={self.k}: {word} (χ²={self.statistic:.1f}, df={self.dof}, "
            f"p={self.p_value:.3g}{extra}; TV={self.tv:.3f} vs {self.tv_null:.3f} expected, "
            f"true TV ≤ {self.tv_upper:.3f}; detects TV ≥ {self.detectable_tv:.3f} at 90% power)"
        )


def fit_test(
    probs: torch.Tensor,
    counts: torch.Tensor,
    threshold: float,
    generator: torch.Generator,
    prompt_index: int = 0,
    k: int = 1,
) -> FitTest:
    """Chi-square of ``counts`` ``[C]`` against ``probs`` ``[C]`` on pooled cells; TV and its bound alongside."""
    samples = int(counts.sum())
    groups = pool_cells(probs, samples)
    kept = groups >= 0
    n_groups = int(groups.max()) + 1 if kept.any() else 0
    expected = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups[kept], probs[kept] * samples)
    observed = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, groups[kept], counts[kept].double())
    impossible = int(counts[~kept].sum())
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = n_groups - 1
    p_value = float(chi2.sf(statistic, dof)) if dof > 0 else 1.0
    tv = 0.5 * float((observed - expected).abs().sum() / samples) + 0.5 * impossible / samples
    tv_null = null_tv(expected / samples, samples, generator)
    upper = tv_upper_bound(tv, n_groups + bool(impossible), samples, threshold)
    _, hidden = pooled_shape(probs, samples)
    return FitTest(
        prompt_index, k, samples, n_groups, statistic, dof, p_value, impossible, tv, tv_null, upper, threshold,
        hidden,
    )  # fmt: skip


@dataclass(frozen=True)
class ExactnessReport:
    """Every test, the family false-alarm rate ``alpha`` and the per-test (Bonferroni) threshold."""

    tests: tuple[FitTest, ...]
    alpha: float
    threshold: float
    drafted: int
    accepted: int
    tree_rounds: int = 0  # rounds that verified a token tree
    sibling_accepts: int = 0  # accepted tree nodes that were not their parent's first child

    @property
    def passed(self) -> bool:
        """No test rejected exactness."""
        return not any(test.rejected for test in self.tests)

    @property
    def verdict(self) -> str:
        """One line: the overall verdict with its false-alarm rate."""
        failed = sum(test.rejected for test in self.tests)
        if self.passed:
            return (
                f"PASS: all {len(self.tests)} tests consistent with the target's distribution "
                f"(family false-alarm rate {self.alpha:g})"
            )
        return f"FAIL: {failed} of {len(self.tests)} tests reject exactness (family false-alarm rate {self.alpha:g})"

    def to_dict(self) -> dict:
        """Plain data for ``--json``."""
        tests = [
            {**dataclasses.asdict(t), "rejected": t.rejected, "detectable_tv": t.detectable_tv, "verdict": t.verdict}
            for t in self.tests
        ]
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {
            "passed": self.passed,
            "verdict": self.verdict,
            "alpha": self.alpha,
            "threshold": self.threshold,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": rate,
            "tests": tests,
        }


def check_exactness(
    target: LoadedModel,
    proposer: Proposer,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    samples: int = 1000,
    gamma: int = 4,
    mode: str = "exact",
    alpha: float = 0.01,
    cap: int = 64,
    seed: int = 0,
    on_sample: Callable[[], None] | None = None,
) -> ExactnessReport:
    """Sample the first two tokens ``samples`` times per prompt (seeds seed, seed+1, …) and test K = 1, 2."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not prompts:
        raise ValueError("check-exact needs at least one prompt")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"check-exact needs an integer gamma >= 1 (a full first round), got {gamma!r}")
    decoder = SpeculativeDecoder(target, proposer, gamma=gamma, mode=mode)
    threshold = alpha / (2 * len(prompts))
    generator = torch.Generator().manual_seed(seed)
    tests: list[FitTest] = []
    drafted = accepted = tree_rounds = sibling_accepts = 0
    for index, prompt_ids in enumerate(prompts):
        first = first_token_law(target, prompt_ids, params)
        pairs = pair_law(target, prompt_ids, params, cap)
        first_counts = torch.zeros_like(first)
        pair_counts = torch.zeros_like(pairs.probs)
        for i in range(samples):
            run = dataclasses.replace(params, max_new_tokens=gamma + 1, seed=seed + i, stop=())
            out = decoder.generate(prompt_ids, run)
            first_counts[out.token_ids[0]] += 1
            pair_counts[pairs.cell(out.token_ids[:2])] += 1
            drafted += out.stats.drafted
            accepted += out.stats.accepted
            tree_rounds += out.stats.tree_rounds
            sibling_accepts += out.stats.sibling_accepts
            if on_sample is not None:
                on_sample()
        tests.append(fit_test(first, first_counts, threshold, generator, index, 1))
        tests.append(fit_test(pairs.probs, pair_counts, threshold, generator, index, 2))
    return ExactnessReport(tuple(tests), alpha, threshold, drafted, accepted, tree_rounds, sibling_accepts)
