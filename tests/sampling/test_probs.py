"""Logits → probabilities: temperature → top-k → top-p on hand-computed cases, greedy one-hot, drawing."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.kernels import unavailable
from helpers.laws import chisquare_pvalue

from specdecode import SamplingParams, kernels
from specdecode.sampling.choices import GeneratorChoices, inverse_cdf, inverse_cdf_torch
from specdecode.sampling.probs import probs_from_logits, sample, warp_logits


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is ``probs`` (float32, like a runner's output)."""
    return torch.tensor([math.log(p) if p > 0 else float("-inf") for p in probs], dtype=torch.float32)


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_temperature_scales_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    for temperature in (0.25, 1.0, 2.0):
        torch.testing.assert_close(warp_logits(logits, temperature), logits / temperature)
        probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


def test_warp_rejects_temperature_zero():
    with pytest.raises(ValueError, match="temperature"):
        warp_logits(torch.zeros(4), 0.0)


def test_greedy_is_one_hot_argmax_with_first_index_on_ties():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 0.0, 0.0, 5.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0, -5.0])
    assert kept(warp_logits(logits, 1.0, top_k=2)) == {1, 2}
    assert kept(warp_logits(logits, 1.0, top_k=1)) == {1}
    assert kept(warp_logits(logits, 1.0, top_k=5)) == {0, 1, 2, 3, 4}
    assert kept(warp_logits(logits, 1.0, top_k=0)) == {0, 1, 2, 3, 4}
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 1 / math.e, 0.0, 0.0]) / (1 + 1 / math.e))


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert kept(warp_logits(logits, 1.0, top_k=2)) == {1, 2}
    assert kept(warp_logits(logits, 1.0, top_k=1)) == {1, 2}  # a tie is not broken arbitrarily


def test_top_p_keeps_the_token_that_crosses_top_p():
    logits = logits_of([0.1, 0.5, 0.05, 0.3, 0.05])
    # sorted: 0.5, 0.3, 0.1, 0.05, 0.05 → cumulative 0.5, 0.8, 0.9, ...
    assert kept(warp_logits(logits, 1.0, top_p=0.3)) == {1}
    assert kept(warp_logits(logits, 1.0, top_p=0.55)) == {1, 3}  # 0.3 crosses 0.55 and is kept
    assert kept(warp_logits(logits, 1.0, top_p=0.79)) == {1, 3}
    assert kept(warp_logits(logits, 1.0, top_p=0.81)) == {0, 1, 3}
    assert kept(warp_logits(logits, 1.0, top_p=1.0)) == {0, 1, 2, 3, 4}
    assert kept(warp_logits(logits, 1.0, top_p=1e-9)) == {1}
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.55))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.625, 0.0, 0.375, 0.0]))


def test_top_p_breaks_ties_by_lower_id():
    logits = logits_of([0.2, 0.4, 0.4])
    assert kept(warp_logits(logits, 1.0, top_p=0.3)) == {1}
    logits = logits_of([0.1, 0.3, 0.3, 0.3])
    assert kept(warp_logits(logits, 1.0, top_p=0.5)) == {1, 2}


def reference_nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """Brute force: walk tokens by descending probability (lower id first on ties) until the mass reaches top_p."""
    probs = torch.softmax(logits.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    chosen, mass = set(), 0.0
    for i in order:
        chosen.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return chosen


def test_top_p_matches_a_brute_force_nucleus_on_random_logits():
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(200, generator=generator) * 3
        for top_p in (1e-6, 0.1, 0.5, 0.9, 0.99, 0.999999, 1.0):
            assert kept(warp_logits(logits, 1.0, top_p=top_p)) == reference_nucleus(logits, top_p)
    assert len(kept(warp_logits(logits, 1.0, top_p=1.0))) == 200


def test_temperature_applies_before_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0])
    # T=1: probs 0.665, 0.245, 0.090 → top_p 0.8 keeps {0, 1}; T=0.5: 0.867, 0.117, 0.016 → keeps {0}
    assert kept(warp_logits(logits, 1.0, top_p=0.8)) == {0, 1}
    assert kept(warp_logits(logits, 0.5, top_p=0.8)) == {0}
    # T=3: 0.481, 0.345, 0.174 → keeps {0, 1}; T=10: 0.367, 0.332, 0.301 → 0.8 needs all three
    assert kept(warp_logits(logits, 10.0, top_p=0.8)) == {0, 1, 2}


def test_top_p_applies_after_top_k_on_the_renormalised_mass():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # top-k 2 → renormalised 0.571, 0.429: top_p 0.5 keeps only token 0.
    # (top-p on the original mass would keep {0, 1}: 0.4 < 0.5.)
    assert kept(warp_logits(logits, 1.0, top_k=2, top_p=0.5)) == {0}
    assert kept(warp_logits(logits, 1.0, top_k=3, top_p=0.6)) == {0, 1}  # 0.444 + 0.333 crosses 0.6
    assert kept(warp_logits(logits, 1.0, top_k=3, top_p=0.8)) == {0, 1, 2}
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    torch.testing.assert_close(probs, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_warps_are_batched_over_leading_dimensions():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.8)
    batched = probs_from_logits(logits, params)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(batched[i, j], probs_from_logits(logits[i, j], params))
    torch.testing.assert_close(batched.sum(-1), torch.ones(2, 3))
    assert ((batched > 0).sum(-1) <= 6).all()


def test_sample_uses_the_generator_and_follows_the_probabilities():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [1, 2]
    rows = torch.tensor([0.1, 0.6, 0.0, 0.3]).expand(20_000, 4)
    draws = sample(rows, torch.Generator().manual_seed(0))
    again = sample(rows, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
    counts = torch.bincount(draws, minlength=4) / 20_000
    assert counts[2] == 0
    # 5 standard deviations at n = 20,000 is < 0.02 for every cell
    torch.testing.assert_close(counts, torch.tensor([0.1, 0.6, 0.0, 0.3]), atol=0.02, rtol=0)


def test_inverse_cdf_draws_follow_an_unnormalised_law_with_zeros():
    """``GeneratorChoices.draw`` and ``sample`` invert the cumulative sums at a uniform: on a 49,152-entry law
    (half of it zero, not normalised) 40,000 draws pass a chi-square test at p > 1e-3 (false alarm 0.001 with
    this seed), no zero-mass entry is ever drawn, and a one-token ``draw_distinct`` follows the same law."""
    generator = torch.Generator().manual_seed(3)
    mass = torch.rand(49_152, generator=generator) ** 8 * 7.0
    mass[:50] = torch.linspace(1, 50, 50) * 400  # most of the mass in a few cells: power to see a bias
    mass[::2] = 0.0
    choices = GeneratorChoices(torch.Generator().manual_seed(4))
    draws = torch.tensor([choices.draw(mass) for _ in range(20_000)])
    distinct = torch.cat([choices.draw_distinct(mass, 1) for _ in range(20_000)])
    for found in (draws, distinct):
        counts = torch.bincount(found, minlength=mass.numel())
        assert counts[mass == 0].sum() == 0
        assert chisquare_pvalue(counts.numpy(), mass.numpy()) > 1e-3


def test_distinct_draws_follow_the_law_without_replacement():
    """Ordered pairs from ``draw_distinct(p, 2)`` on p = (0.5, 0.3, 0.2, 0): P(i, j) = p_i p_j / (1 − p_i), never a
    repeat or the zero-mass token (chi-square over 20,000 pairs at p > 1e-3)."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    choices = GeneratorChoices(torch.Generator().manual_seed(5))
    pairs = [tuple(choices.draw_distinct(probs, 2).tolist()) for _ in range(20_000)]
    assert all(i != j and 3 not in (i, j) for i, j in pairs)
    cells = [(i, j) for i in range(3) for j in range(3) if i != j]
    law = [float(probs[i] * probs[j] / (1 - probs[i])) for i, j in cells]
    assert chisquare_pvalue([pairs.count(cell) for cell in cells], law) > 1e-3
    assert choices.draw_distinct(probs, 3).sort().values.tolist() == [0, 1, 2]


@pytest.mark.parametrize("draw", [inverse_cdf, inverse_cdf_torch], ids=["kernels", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inverse_cdf_edges(draw, dtype):
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0], dtype=dtype)
    at = lambda u: int(draw(probs, torch.tensor(u, dtype=torch.float64)))  # noqa: E731
    assert at(0.0) == 1  # the first entry with mass, never the zero before it
    edge = float(probs[:2].double().sum() / probs.double().sum())  # 0.2 as the dtype holds it (float32: 0.2 + 2.7e-9)
    assert at(edge - 1e-12) == 1 and at(edge + 1e-12) == 3
    assert at(1.0 - 2**-53) == 4 and at(1.0) == 4  # u·C rounded up to C: the last entry with mass
    batched = draw(probs.expand(3, 6), torch.tensor([0.0, 0.5, 0.99], dtype=torch.float64))
    assert batched.tolist() == [1, 3, 4]
    with pytest.raises(ValueError, match="no positive, finite mass"):
        draw(torch.zeros(4, dtype=dtype), torch.tensor(0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN"):
        draw(torch.tensor([0.5, float("nan")], dtype=dtype), torch.tensor(0.5, dtype=torch.float64))


def test_the_kernels_draw_where_the_torch_ops_draw():
    """``inverse_cdf`` on the kernels (block sums) picks the index ``inverse_cdf_torch`` (one cumsum) picks, on
    random rows of 1..49,152 entries (float32 and float64, a third of them with zero runs) at 64 uniforms each,
    u = 0 and u just below 1 included: the two orders of summation differ by float64 rounding only."""
    if kernels.ops() is None:
        unavailable("the CPU kernels did not build here")
    rows = torch.Generator().manual_seed(12)
    for case in range(120):
        vocab = (49_152, 64, 65, 1)[case % 4] if case < 8 else int(torch.randint(1, 2_000, (), generator=rows))
        probs = torch.rand(vocab, generator=rows, dtype=torch.float64) ** 4
        if case % 3 == 0:
            probs[torch.rand(vocab, generator=rows) < 0.7] = 0.0
            probs[-1] = probs[-1] + 1e-3
        if case % 2:
            probs = probs.float()
        uniforms = torch.cat(
            [
                torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64),
                torch.rand(62, generator=rows, dtype=torch.float64),
            ]
        )
        grid = probs.expand(64, vocab)
        assert torch.equal(inverse_cdf(grid, uniforms), inverse_cdf_torch(grid, uniforms)), case
