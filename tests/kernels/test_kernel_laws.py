"""The compiled exact-sampling kernels' laws, computed exactly from the real ops (issue 53).

``exact_chain`` (verify.speculative_sample on float32 CPU rows) and ``inverse_cdf_rows`` (choices.inverse_cdf) are
deterministic functions of their float64 uniforms, monotone in the draw uniform (an inverse CDF) and a threshold in
each accept uniform (accept iff u < ratio). So their law is a set of interval lengths: bisecting on the bits of a
double finds, for each token j, the smallest uniform whose output is ≥ j (``boundary``), to the last bit; the
probability of j is the length between j's and j + 1's boundaries, and the probability of accepting guess i is the
smallest uniform that rejects it. Each length is compared with the law the rule promises — norm(max(0, p − q)) after
a rejection at row i (p with the guess zeroed for a point mass), p after all k accepted, min(1, p/q) for each guess,
p for ``inverse_cdf_rows`` — to TOLERANCE = 1e-12.

Why 1e-12 and not a sampling bound: there is no sampling. A boundary is found to one ulp (≤ 1.1e-16); the op sums
its cumulative mass in float64 over at most V/64 block sums plus 64 entries (kernels.cpp, "exact sampling"), whose
rounding moves a boundary by ≲ (V/64 + 64)·2⁻⁵³ ≈ 5e-13 at V = 262,144 in the worst case (measured: ≤ ~1e-15 at
every V here). A kernel bias any sampled test could see (TV ≥ 1e-4) is eight orders of magnitude above it.

At V = 8 every boundary of every row is found (chains of 8). At V = 49,157 (not a multiple of 64: the last block
has 5 entries) and 262,144 a few hundred tokens are checked — random ones (with and without mass), the block edges
the op's blocked sums turn on, the likeliest — with the bisection started in a 2e-10 bracket around the exact
boundary (the op walks a CDF, so its boundary is where the reference cumulative sum is, to rounding; a bracket that
does not hold falls back to all of [0, 1)), plus the ends: the first token with mass owns u = 0 and the last one the
largest double below 1, so the intervals cover [0, 1).

Controls: the ops are a parameter (``kernel_ops``; a mutant build of the kernels plugs in as another ops object).
Wrappers around the real compiled ops that feed them p mixed 1% with the uniform law, p moved 1% toward q, a residual
mixed 1% with p (a split of the draw uniform, as a mutant build would compute it), or an index shifted by one must
each fail the same checks by ≥ 1000× the tolerance.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.enumeration import residual_mixed_with_p
from helpers.kernels import mutant_build, unavailable

from specdecode import kernels

TOLERANCE = 1e-12
MARGIN = 1000  # a control must miss the law by this many tolerances
ONE_BELOW = float(np.nextafter(1.0, 0.0))
BRACKET = 1e-10  # half-width of the first bracket around the reference boundary (large V)


@pytest.fixture(scope="module")
def kernel_ops():
    ops = kernels.ops()
    if ops is None:
        unavailable("the CPU kernels did not build here")
    return ops


# ------------------------------------------------------------------------------------------------ the bisection


def _bits(u: float) -> int:
    return int(np.float64(u).view(np.int64))


def _double(bits: int) -> float:
    return float(np.int64(bits).view(np.float64))


def boundary(draw, j: int, guess: float | None = None) -> float:
    """min{u, a double in [0, 1): draw(u) ≥ j} (1.0 if none) for ``draw`` monotone non-decreasing in u, to the last
    bit; ``guess`` starts the search in [guess ± BRACKET] when that bracket holds."""
    if draw(0.0) >= j:
        return 0.0
    if draw(ONE_BELOW) < j:
        return 1.0
    lo, hi = 0, _bits(ONE_BELOW)
    if guess is not None:
        below, above = max(0.0, guess - BRACKET), min(ONE_BELOW, guess + BRACKET)
        if draw(below) < j:
            lo = _bits(below)
        if draw(above) >= j:
            hi = _bits(above)
    while hi - lo > 1:  # the bits of non-negative doubles order as the doubles do
        mid = (lo + hi) // 2
        if draw(_double(mid)) >= j:
            hi = mid
        else:
            lo = mid
    return _double(hi)


def drawn_deviation(draw, weights: np.ndarray, tokens: np.ndarray | None = None, premise: bool = True) -> float:
    """max over ``tokens`` (default every token) of |the length of {u: draw(u) = t} − the normalised ``weights``|;
    infinite unless ``draw`` covers [0, 1) as an inverse CDF does: the first token with mass drawn at u = 0, the last
    one at the largest double below 1, and non-decreasing over 64 sorted random uniforms (the bisection's premise;
    ``premise`` False skips that check: the controls show the lengths alone miss too)."""
    reference = weights / weights.sum()
    support = np.flatnonzero(weights > 0)
    uniforms = np.sort(np.random.default_rng(1).random(64))
    ends_held = draw(0.0) == support[0] and draw(ONE_BELOW) == support[-1]
    if premise and (not ends_held or np.any(np.diff([draw(u) for u in uniforms]) < 0)):
        return float("inf")
    tokens = np.arange(len(weights)) if tokens is None else tokens
    before = np.concatenate([[0.0], np.cumsum(reference)])  # the reference boundary of token j: mass before j
    guess = None if len(weights) <= 64 else before
    ends = {j: boundary(draw, j, None if guess is None else guess[j]) for j in {*tokens, *(tokens + 1)}}
    law = np.array([ends[j + 1] - ends[j] for j in tokens])
    return float(np.abs(law - reference[tokens]).max())


def checked_tokens(weights: np.ndarray, count: int, seed: int) -> np.ndarray:
    """Tokens whose interval is measured at a large V: ``count`` random ones (with mass or without), both sides of
    the first block edges, the ten likeliest, the first and the last."""
    rng = np.random.default_rng(seed)
    vocab = len(weights)
    edges = [e + d for e in range(64, min(vocab, 64 * 9), 64) for d in (-1, 0)]
    likeliest = np.argsort(-weights, kind="stable")[:10]
    picked = np.concatenate([rng.choice(vocab, count, replace=False), edges, likeliest, [0, vocab - 1]])
    return np.unique(picked)


# ------------------------------------------------------------------------------------------------ the cases


def softmax_rows(rows: int, vocab: int, generator: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """Float32 rows of peaked random laws, renormalised in float32 (as a runner's softmax gives them)."""
    return torch.softmax(scale * torch.randn(rows, vocab, generator=generator), -1)


def chain_case(vocab: int, k: int, sampled: bool, seed: int):
    """(target [k+1, V], draft [k, V] or None, guesses [k]) float32: q a noisy copy of p (so both accept and reject
    happen); the guesses are tokens q over-weights (p/q < 1, so a rejection is possible at every row), except that
    guess 1 is one p over-weights (ratio ≥ 1: always accepted) when k ≥ 3 with sampled q."""
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(k + 1, vocab, generator=generator)
    target = torch.softmax(logits, -1)
    if not sampled:
        guesses = torch.multinomial(target[:k].double(), 1, generator=generator).flatten()
        return target, None, guesses
    draft = torch.softmax(logits[:k] + torch.randn(k, vocab, generator=generator), -1)
    ratio = target[:k] / draft
    guesses = torch.where(ratio < 1, draft, 0.0).argmax(-1)
    if k >= 3:
        guesses[1] = torch.where(ratio[1] >= 1, target[1], 0.0).argmax()
    return target, draft, guesses


def residual_weights(target: torch.Tensor, draft: torch.Tensor | None, guesses: torch.Tensor, row: int) -> np.ndarray:
    """The law the rule promises after a rejection at ``row`` (unnormalised, float64 from the float32 rows):
    max(0, p − q), p with the guess zeroed for a point mass, p itself when that mass is ≤ 1e-12 (verify)."""
    p = target[row].double().numpy()
    if draft is None:
        weights = p.copy()
        weights[int(guesses[row])] = 0.0
    else:
        weights = np.maximum(0.0, p - draft[row].double().numpy())
    return weights if weights.sum() > 1e-12 else p


def accept_probabilities(target, draft, guesses) -> np.ndarray:
    """min(1, p_i(x_i) / q_i(x_i)) in float64 from the float32 rows (q = 1 for point masses)."""
    rows = torch.arange(len(guesses))
    p = target[rows, guesses].double()
    q = torch.ones_like(p) if draft is None else draft[rows, guesses].double()
    return torch.where(q > 0, p / q, 0.0).clamp_max(1.0).numpy()


def chain_draw(ops, target, draft, guesses, row: int):
    """u ↦ the token exact_chain emits at draw uniform u when it accepts rows < ``row`` and rejects ``row``
    (``row`` = k: all accepted, the bonus); asserts it did."""
    k = len(guesses)
    accept_u = torch.zeros(k, dtype=torch.float64)  # u = 0 < ratio: accepted (every guess here has p > 0)
    if row < k:
        accept_u[row] = ONE_BELOW  # ≥ ratio < 1: rejected

    def draw(u: float) -> int:
        n, token = ops.exact_chain(target, draft, guesses, accept_u, u)
        assert n == row
        return token

    return draw


def chain_threshold(ops, target, draft, guesses, row: int) -> float:
    """The accept uniforms' threshold at ``row``: min{a: exact_chain rejects guess ``row`` at a} with the rows before
    accepted (1.0 if it never rejects), i.e. the probability that guess ``row`` is accepted once reached."""
    accept_u = torch.zeros(len(guesses), dtype=torch.float64)

    def rejected(a: float) -> int:
        accept_u[row] = a
        n, _ = ops.exact_chain(target, draft, guesses, accept_u, 0.5)
        assert n >= row
        return int(n == row)

    return boundary(rejected, 1)


def chain_deviation(ops, target, draft, guesses, rows, count: int = 0, seed: int = 0, premise: bool = True) -> float:
    """max |measured − promised| over the accept probabilities of every guess and the drawn laws at ``rows`` (a
    rejection at row i < k, the bonus at k): every token at a small V, ``count`` tokens and the edges at a large V."""
    k = len(guesses)
    thresholds = np.array([chain_threshold(ops, target, draft, guesses, i) for i in range(k)])
    worst = float(np.abs(thresholds - accept_probabilities(target, draft, guesses)).max(initial=0.0))
    for row in rows:
        weights = residual_weights(target, draft, guesses, row) if row < k else target[row].double().numpy()
        tokens = checked_tokens(weights, count, seed + row) if count else None
        worst = max(worst, drawn_deviation(chain_draw(ops, target, draft, guesses, row), weights, tokens, premise))
    return worst


def inverse_cdf_deviation(ops, probs: torch.Tensor, count: int = 0, seed: int = 0, premise: bool = True) -> float:
    """max |measured − p| of ``inverse_cdf_rows`` on the one row ``probs`` [V]."""
    row = probs.unsqueeze(0)

    def draw(u: float) -> int:
        return int(ops.inverse_cdf_rows(row, torch.tensor([u], dtype=torch.float64))[0])

    weights = probs.double().numpy()
    tokens = checked_tokens(weights, count, seed) if count else None
    return drawn_deviation(draw, weights, tokens, premise)


# ------------------------------------------------------------------------------------------------ the laws

# (vocabulary, chain length, tokens checked per row at a large V); at V = 8 every token of every row
SIZES = [(8, 8, 0), (49_157, 3, 300), (262_144, 2, 200)]  # 49,157: the last block has 5 entries


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "point-masses"])
@pytest.mark.parametrize(("vocab", "k", "count"), SIZES, ids=[f"V{v}-k{k}" for v, k, _ in SIZES])
def test_exact_chain_draws_the_promised_law(kernel_ops, vocab, k, count, sampled):
    """Proves, for the compiled chain rule on float32 rows: guess i is accepted with probability min(1, p_i/q_i)
    (exactly: the threshold is the ratio itself, strict <), and the token after a rejection at row i follows
    norm(max(0, p_i − q_i)) (p_i without the guess for point masses), the bonus p_k — to 1e-12 (module docstring).
    At V = 8 every row of a chain of 8; at the large V a rejection at row 0 and at the last row, and the bonus."""
    target, draft, guesses = chain_case(vocab, k, sampled, seed=vocab + k + sampled)
    rejectable = np.flatnonzero(accept_probabilities(target, draft, guesses) < 1).tolist()
    rows = [*rejectable, k] if vocab <= 64 else sorted({0, k - 1, k})
    assert chain_deviation(kernel_ops, target, draft, guesses, rows, count) <= TOLERANCE
    thresholds = [chain_threshold(kernel_ops, target, draft, guesses, i) for i in range(k)]
    assert thresholds == accept_probabilities(target, draft, guesses).tolist()  # to the bit: u < ratio, strict
    if sampled and k >= 3:
        assert thresholds[1] == 1.0  # p ≥ q: always accepted


def test_exact_chain_accepts_a_guess_the_target_excludes_never(kernel_ops):
    """Proves the strict comparison: a guess with p = 0 is rejected even at u = 0 (a ≤ would accept it with the
    probability that u is 0), and one with q = 0 too; the token that follows is from the residual."""
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.5, 0.0, 0.0, 0.5]])
    zero = torch.zeros(1, dtype=torch.float64)
    for guess in (0, 1):  # p = 0, then q = 0
        n, token = kernel_ops.exact_chain(target, draft, torch.tensor([guess]), zero, 0.0)
        assert (n, token) == (0, 1)
    assert chain_threshold(kernel_ops, target, draft, torch.tensor([0]), 0) == 0.0


def test_the_chain_token_depends_on_the_accepted_count_only(kernel_ops):
    """Proves the joint law factorises as the tests above assume: for random accept uniforms that give the same
    accepted count n, exact_chain emits the same token at the same draw uniform (V = 8, k = 8, 2,000 calls)."""
    target, draft, guesses = chain_case(8, 8, True, seed=3)
    rng = np.random.default_rng(0)
    for _ in range(2000):
        accept_u = torch.from_numpy(rng.random(8))
        u = float(rng.random())
        n, token = kernel_ops.exact_chain(target, draft, guesses, accept_u, u)
        assert chain_draw(kernel_ops, target, draft, guesses, n)(u) == token


@pytest.mark.parametrize(("vocab", "count"), [(8, 0), (49_157, 300), (262_144, 300)])
def test_inverse_cdf_rows_draws_p(kernel_ops, vocab, count):
    """Proves the compiled inverse-CDF draw (every sampled token of exact mode: proposers, plain decoding, a
    residual after a tree's rejection) follows p to 1e-12 on a float32 row, with a quarter of the vocabulary at
    zero mass (never drawn: a zero-length interval), across the op's 64-entry blocks."""
    generator = torch.Generator().manual_seed(vocab)
    probs = softmax_rows(1, vocab, generator)[0]
    probs[torch.randperm(vocab, generator=generator)[: vocab // 4]] = 0.0
    assert inverse_cdf_deviation(kernel_ops, probs, count) <= TOLERANCE


# ------------------------------------------------------------------------------------------------ the controls


_last_mixed: list = [None, None]  # (input rows, mixed rows): the bisection calls a mutant on one row ~10⁴ times


def _mixed(rows: torch.Tensor, other: torch.Tensor, share: float) -> torch.Tensor:
    if _last_mixed[0] is not rows:
        _last_mixed[:] = [rows, ((1 - share) * rows.double() + share * other.double()).float()]
    return _last_mixed[1]


def _uniform_like(rows: torch.Tensor) -> torch.Tensor:
    return torch.full_like(rows, 1.0 / rows.shape[-1])


def mutant(ops, name: str):
    """The real compiled ops behind one deliberate error (each a bias a mutant build could make)."""
    if name == "p-mixed-1%-uniform":
        return SimpleNamespace(
            exact_chain=lambda p, q, x, a, u: ops.exact_chain(_mixed(p, _uniform_like(p), 0.01), q, x, a, u),
            inverse_cdf_rows=lambda p, u: ops.inverse_cdf_rows(_mixed(p, _uniform_like(p), 0.01), u),
        )
    if name == "p-moved-1%-toward-q":

        def toward_q(p, q, x, a, u):
            q_rows = torch.nn.functional.one_hot(x, p.shape[-1]).float() if q is None else q
            moved = p.clone()
            moved[:-1] = _mixed(p[:-1], q_rows, 0.01)  # the bonus row has no q
            return ops.exact_chain(moved, q, x, a, u)

        return SimpleNamespace(exact_chain=toward_q, inverse_cdf_rows=ops.inverse_cdf_rows)
    if name == "residual-mixed-1%-with-p":
        return residual_mixed_with_p(ops, 0.01)
    if name == "index-shifted":

        def shifted_chain(p, q, x, a, u):
            n, token = ops.exact_chain(p, q, x, a, u)
            return [n, (token + 1) % p.shape[-1]]

        return SimpleNamespace(
            exact_chain=shifted_chain,
            inverse_cdf_rows=lambda p, u: (ops.inverse_cdf_rows(p, u) + 1) % p.shape[-1],
        )
    raise ValueError(name)


CHAIN_CONTROLS = {  # mutant -> the rows whose law it breaks (the accept probabilities are always checked)
    "p-mixed-1%-uniform": "bonus",
    "p-moved-1%-toward-q": "accept",  # max(0, p' − q) ∝ max(0, p − q): only the accept probabilities move
    "residual-mixed-1%-with-p": "rejection",
    "index-shifted": "rejection",
}


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "point-masses"])
@pytest.mark.parametrize("vocab", [8, 49_157])
@pytest.mark.parametrize("name", list(CHAIN_CONTROLS))
def test_control_a_biased_chain_kernel_is_caught(kernel_ops, name, vocab, sampled):
    """The chain law check run on the real compiled op behind one deliberate error: it must miss the promised law
    by ≥ 1000× the tolerance (at V = 49,157 on 40 tokens a row), and the interval lengths alone must miss it too
    (not only the inverse-CDF premise: a mixed or shifted draw breaks that at once)."""
    k = 3
    target, draft, guesses = chain_case(vocab, k, sampled, seed=7 + sampled)
    rows = {"bonus": [k], "accept": [], "rejection": [0]}[CHAIN_CONTROLS[name]]
    ops, count = mutant(kernel_ops, name), 0 if vocab <= 64 else 40
    for premise in (True, False):
        deviation = chain_deviation(ops, target, draft, guesses, rows, count, premise=premise)
        assert deviation > MARGIN * TOLERANCE, (name, premise, deviation)


@pytest.mark.parametrize("vocab", [8, 49_152, 262_144])
@pytest.mark.parametrize("name", ["p-mixed-1%-uniform", "index-shifted"])
def test_control_a_biased_inverse_cdf_kernel_is_caught(kernel_ops, name, vocab):
    """The inverse-CDF law check on the real op behind one deliberate error: missed by ≥ 1000× the tolerance."""
    generator = torch.Generator().manual_seed(vocab)
    probs = softmax_rows(1, vocab, generator)[0]
    for premise in (True, False):
        deviation = inverse_cdf_deviation(mutant(kernel_ops, name), probs, 0 if vocab <= 64 else 40, premise=premise)
        assert deviation > MARGIN * TOLERANCE, (name, premise, deviation)


def strict_case():
    """A guess the target excludes (p = 0): accepted with probability exactly 0, so the accept uniforms' threshold
    is 0.0 itself (u = 0 must reject: a ≤ would accept it)."""
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    return target, torch.tensor([[0.5, 0.0, 0.0, 0.5]]), torch.tensor([0])


def small_residual_case(vocab: int = 8, seed: int = 9, mass: float = 5e-5):
    """q = p but for ``mass`` moved from p's second likeliest token b to its likeliest a, the guess: a rejection
    leaves a residual of mass ≈ 5e-5 on b alone — above the eps fallback (1e-12), so the token drawn is b."""
    target = softmax_rows(2, vocab, torch.Generator().manual_seed(seed))
    a, b = torch.argsort(target[0], descending=True)[:2].tolist()
    draft = target[:1].clone()
    draft[0, a] += mass
    draft[0, b] -= mass
    return target, draft, torch.tensor([a])


NOT_A_MULTIPLE_OF_64 = 8 * 64 + 37  # the draws' block walk ends in a partial block of 37 entries

# mutant build -> (the chain case whose law it breaks: target, draft, guesses; the rows whose draws are checked)
MUTANT_CASES = {
    "mutant_residual": lambda: (chain_case(8, 3, True, seed=8), [0]),
    "mutant_index": lambda: (chain_case(8, 3, True, seed=8), [0]),
    "mutant_accept": lambda: (strict_case(), [0]),
    "mutant_point_mass": lambda: (chain_case(8, 3, False, seed=8), [0]),
    "mutant_eps": lambda: (small_residual_case(), [0]),
    "mutant_block": lambda: (chain_case(NOT_A_MULTIPLE_OF_64, 2, True, seed=5), [0, 2]),
}


def test_every_mutant_build_has_a_case():
    assert set(MUTANT_CASES) == set(kernels.MUTANTS)


@pytest.mark.parametrize("variant", list(kernels.MUTANTS))
def test_control_a_mutant_build_of_the_kernels_is_caught(kernel_ops, variant, monkeypatch):
    """The same law checks on a mutant *build* (kernels.MUTANTS: the fault compiled into sampling.h, not a Python
    wrapper), each on a case where the real build keeps the law (deviation ≤ 1e-12, every accept threshold the
    ratio to the bit) and the mutant misses it: by ≥ 1000× the tolerance (the residual mixed with p, the index
    shift, the point mass keeping its guess, a 5e-5 residual taken for p, a last block of 37 entries never drawn),
    or, for accept iff u ≤ p/q, by a threshold that is not the ratio (a guess with p = 0 accepted at u = 0). The
    index and block faults fail the inverse CDF's law too."""
    ops = mutant_build(variant, monkeypatch)
    (target, draft, guesses), rows = MUTANT_CASES[variant]()

    def thresholds_exact(build) -> bool:
        found = [chain_threshold(build, target, draft, guesses, i) for i in range(len(guesses))]
        return found == accept_probabilities(target, draft, guesses).tolist()

    assert chain_deviation(kernel_ops, target, draft, guesses, rows) <= TOLERANCE and thresholds_exact(kernel_ops)
    if variant == "mutant_accept":
        assert not thresholds_exact(ops)
        assert chain_threshold(ops, target, draft, guesses, 0) > 0.0  # u = 0 accepts the excluded guess
    for premise in (True, False):
        if variant != "mutant_accept":
            deviation = chain_deviation(ops, target, draft, guesses, rows, 0, premise=premise)
            assert deviation > MARGIN * TOLERANCE, (variant, premise, deviation)
    if variant in ("mutant_index", "mutant_block"):
        vocab = 8 if variant == "mutant_index" else NOT_A_MULTIPLE_OF_64
        probs = softmax_rows(1, vocab, torch.Generator().manual_seed(8))[0]
        assert inverse_cdf_deviation(kernel_ops, probs) <= TOLERANCE
        assert inverse_cdf_deviation(ops, probs, premise=False) > MARGIN * TOLERANCE
