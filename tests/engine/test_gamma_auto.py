"""gamma="auto": decisions tested by counting rounds, with fixed (injected) costs so nothing depends on timing."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from helpers.models import LARGE_VOCAB, tiny_llama

import specdecode as sd
from specdecode.control import AcceptanceHistory, AdaptiveGamma, PassCosts
from specdecode.sampling.draft import Draft


def fixed_costs(step: float = 1.0, extra_per_token: float = 0.05, draft_per_token: float = 0.1) -> PassCosts:
    """v(k) = 1 + 0.05 (k-1) and c = 0.1 by default, frozen."""
    return PassCosts.line(step, extra_per_token, {"": draft_per_token})


def test_useless_proposer_is_switched_off_then_probed_rarely():
    controller = AdaptiveGamma(max_gamma=8, costs=fixed_costs())
    choices = []
    for _ in range(400):
        gamma = controller.choose()
        choices.append(gamma)
        controller.observe(drafted=gamma, accepted=0)
    first_off = choices.index(0)
    assert first_off <= 16  # m + sd of the Beta(1, 1) posterior after k rejections falls below 0.15 at k ~ 15
    probes_after = sum(1 for g in choices[first_off:] if g > 0)
    # probe intervals double from 8: 8 + 16 + 32 + 64 + 128 + 256 > 400 rounds → at most 6 probes
    assert probes_after <= 6
    assert all(g <= 1 for g in choices[first_off:])


def test_perfect_proposer_climbs_to_the_cap():
    controller = AdaptiveGamma(max_gamma=8, costs=fixed_costs(draft_per_token=0.0))
    choices = []
    for _ in range(60):
        gamma = controller.choose()
        choices.append(gamma)
        controller.observe(drafted=gamma, accepted=gamma)
    assert choices[-20:] == [8] * 20


def test_a_perfect_proposer_climbs_to_the_cap_where_each_verify_row_costs_a_quarter_step():
    # this CPU's verify cost (v(8) ~ 2.6): with a 1/2 prior on unreached depths the gain of a deeper guess never
    # covered a row, so a proposer that was always right stayed near gamma = 3
    controller = AdaptiveGamma(max_gamma=8, costs=fixed_costs(extra_per_token=0.25, draft_per_token=0.0))
    choices = []
    for _ in range(40):
        gamma = controller.choose()
        choices.append(gamma)
        controller.observe(drafted=gamma, accepted=gamma)
    assert choices[-10:] == [8] * 10 and choices.index(8) < 12


def test_free_drafting_with_flat_verify_always_pays():
    controller = AdaptiveGamma(max_gamma=4, costs=fixed_costs(extra_per_token=0.0, draft_per_token=0.0))
    for _ in range(50):
        controller.observe(drafted=controller.choose(), accepted=0)
    assert controller.predicted_speedup(1) > 1.0  # any α > 0 pays when drafting and verifying are free


def _tree_rounds(price_trees: bool) -> list[int]:
    """200 rounds of a proposer whose every tree has 32 nodes (33 verified rows, 2 steps of drafting) and whose
    first guess is accepted 3 times in 5; v(k) = 1 + 0.05 (k-1), so a tree round costs 4.6 steps."""
    costs = PassCosts({1: 1.0}, {"": 0.1}, slope=0.05)  # as fixed_costs(), but learning trees (no pass observed)
    controller = AdaptiveGamma(max_gamma=4, costs=costs)
    choices = []
    for i in range(200):
        gamma = controller.choose()
        choices.append(gamma)
        if gamma:
            accepted = int(i % 5 < 3)
            controller.observe(drafted=accepted + 1, accepted=accepted)
            if price_trees:
                controller.observe_tree(rows=33, draft_seconds=2.0)
    return choices


def test_trees_are_priced_at_their_size_and_switched_off_when_they_do_not_pay():
    priced = _tree_rounds(price_trees=True)
    assert sum(g > 0 for g in priced[50:]) <= 4  # off, with rare probes
    # the control: priced as chains (v(γ+1) + γc) the same acceptance looks worth speculating for
    unpriced = _tree_rounds(price_trees=False)
    assert sum(g > 0 for g in unpriced[50:]) >= 140


def test_auto_opens_with_a_plain_round_to_measure_the_step():
    """Without a measured 1-token step every cost reads as free; a proposer that always drafts would never
    produce the plain round that measures it."""
    costs = PassCosts()
    controller = AdaptiveGamma(max_gamma=4, costs=costs)
    assert controller.choose() == 0
    costs.observe(verified=1, verify_seconds=0.01, drafted=0, draft_seconds=0.0)
    assert controller.choose() > 0  # the prior's acceptance with costs now known


def test_cost_model_measures_linear_verify_cost_and_draft_cost():
    costs = PassCosts(smoothing=1.0)
    costs.observe(verified=1, verify_seconds=0.02, drafted=0, draft_seconds=0.0)
    costs.observe(verified=5, verify_seconds=0.03, drafted=4, draft_seconds=0.008)
    assert abs(costs.verify_cost(5) - 1.5) < 1e-9
    assert abs(costs.verify_cost(9) - 2.0) < 1e-9
    assert abs(costs.draft_cost() - 0.1) < 1e-9


class RandomProposer:
    """Proposes uniformly random tokens (almost never accepted); records every k it is asked for."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.asked: list[int] = []
        self.rng = torch.Generator().manual_seed(0)

    def propose(self, context, k, params, generator):
        self.asked.append(k)
        return Draft(torch.randint(0, self.vocab_size, (k,), generator=self.rng))


def _auto_decoder(costs: PassCosts) -> tuple[sd.LoadedModel, RandomProposer, sd.SpeculativeDecoder]:
    """A tiny target, a random proposer and a gamma="auto" decoder over them pricing rounds with ``costs``."""
    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=3))
    proposer = RandomProposer(LARGE_VOCAB)
    decoder = sd.SpeculativeDecoder(target, proposer, gamma="auto")
    decoder.costs = costs
    return target, proposer, decoder


def test_engine_auto_gamma_turns_a_useless_proposer_off_and_stays_greedy_identical():
    target, proposer, decoder = _auto_decoder(fixed_costs())
    params = sd.SamplingParams(max_new_tokens=120)
    prompt = list(range(10))
    out = decoder.generate(prompt, params)
    assert out.token_ids == sd.autoregressive_generate(target, prompt, params).token_ids
    first_off = proposer.asked.index(0)
    assert first_off <= 16  # a random token is still accepted now and then, so allow a few more rounds
    assert sum(k > 0 for k in proposer.asked[first_off:]) <= len(proposer.asked[first_off:]) // 10


class WrongProposer:
    """Drafts, after each context, the token after the one greedy decoding picks there (``sequence``: the prompt and
    plain decoding's output), so greedy verification rejects every first guess; records every k it is asked for."""

    def __init__(self, sequence: list[int], vocab_size: int) -> None:
        self.sequence = sequence
        self.vocab_size = vocab_size
        self.asked: list[int] = []

    def propose(self, context, k, params, generator):
        self.asked.append(k)
        following = self.sequence[len(context) : len(context) + k]
        return Draft(torch.tensor([(token + 1) % self.vocab_size for token in following], dtype=torch.int64))


def test_the_api_default_is_auto_and_switches_a_proposer_that_is_never_accepted_off():
    """``SpeculativeDecoder(target, proposer)`` is ``gamma="auto"``: over 300 tokens a proposer that is never right
    drafts in a handful of rounds, then only one-token probes at doubling intervals, and the text is plain's."""
    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=3))
    params = sd.SamplingParams(max_new_tokens=300)
    prompt = list(range(10))
    plain = sd.autoregressive_generate(target, prompt, params).token_ids
    timed = sd.SpeculativeDecoder(target, WrongProposer(prompt + plain, LARGE_VOCAB))  # costs measured on the clock
    assert timed.gamma == "auto" and timed.generate(prompt, params).token_ids == plain
    proposer = WrongProposer(prompt + plain, LARGE_VOCAB)
    decoder = sd.SpeculativeDecoder(target, proposer)
    decoder.costs = fixed_costs()  # v(k) = 1 + 0.05 (k - 1), c = 0.1: the rounds below depend on no clock
    out = decoder.generate(prompt, params)
    assert out.token_ids == plain and out.stats.accepted == 0
    asked = proposer.asked
    assert len(asked) == 300  # one token a round: nothing is ever accepted
    first_off = asked.index(0)
    assert first_off <= 8 and all(k <= 1 for k in asked[first_off:])  # off, then one-token probes only
    assert sum(k > 0 for k in asked[100:]) <= 2  # probe intervals double: 64 and 128 rounds by then
    assert out.stats.drafted <= 20  # of 300 tokens; a fixed gamma = 4 would have drafted 4 a round


def test_auto_gamma_is_validated():
    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=3))
    for bad in ("fast", 0, -1, 2.5, True):
        try:
            sd.SpeculativeDecoder(target, gamma=bad)
        except ValueError as exc:
            assert "gamma" in str(exc)
        else:
            raise AssertionError(f"gamma={bad!r} was accepted")


def test_cost_model_keeps_a_step_in_verify_cost_that_a_line_would_hide():
    costs = PassCosts(smoothing=1.0)
    costs.observe(verified=1, verify_seconds=0.040, drafted=0, draft_seconds=0.0)
    costs.observe(verified=3, verify_seconds=0.044, drafted=2, draft_seconds=0.0)
    costs.observe(verified=5, verify_seconds=0.068, drafted=4, draft_seconds=0.0)
    assert abs(costs.verify_cost(3) - 1.1) < 1e-9  # measured at k = 3, not the line's value
    assert abs(costs.verify_cost(5) - 1.7) < 1e-9
    controller = AdaptiveGamma(max_gamma=4, costs=costs)
    for _ in range(30):
        controller.observe(drafted=4, accepted=1)  # a_1 high-ish, later positions rarely reached
    assert controller.predicted_speedup(2) > controller.predicted_speedup(4)


def test_gamma_grows_at_most_to_twice_the_deepest_measured_round():
    """An unmeasured v(k) reads as 1 (or the line), which made the first drafting round of a decoder γ = max;
    now a round reaches at most twice the deepest round already timed: 1, 2, 4, 8."""
    costs = PassCosts(smoothing=1.0)
    controller = AdaptiveGamma(max_gamma=8, costs=costs)
    choices = []
    for _ in range(40):
        gamma = controller.choose()
        choices.append(gamma)
        costs.observe(gamma + 1, 0.01 * (1 + 0.05 * gamma), gamma, 0.0)  # v(k) = 1 + 0.05 (k - 1), c = 0
        controller.observe(drafted=gamma, accepted=gamma)  # always right
    for i, gamma in enumerate(choices):
        assert gamma <= max(1, 2 * max(choices[:i], default=0))
    assert choices[:5] == [0, 1, 2, 4, 8] and [g for g in choices[-10:] if g] == [8] * 9  # and a re-timing round


def _memory_of(acceptance_pattern: list[int], rounds: int = 200) -> AcceptanceHistory:
    """A decoder's memory after ``rounds`` of γ = 1 accepting as the pattern says."""
    memory = AcceptanceHistory()
    for i in range(rounds):
        memory.observe(1, acceptance_pattern[i % len(acceptance_pattern)])
    return memory


def test_a_new_request_starts_from_the_decoders_memory():
    costs = fixed_costs()  # γ = 1 breaks even at a_1 = 0.15
    useless = AdaptiveGamma(8, costs, _memory_of([0]))
    assert useless.choose() == 0  # not a round at the 1/2 prior
    good = AdaptiveGamma(8, costs, _memory_of([1, 1, 0, 0, 0]))  # 40% accepted
    assert abs(good.acceptance.estimate(8)[0] - 0.4) < 0.02
    assert good.choose() >= 1
    assert AdaptiveGamma(8, costs).choose() >= 1  # no memory: the Beta(1, 1) prior drafts


def _drafting_rounds_after_a_dip(memory: AcceptanceHistory | None) -> int:
    """30 rounds in which every guess is rejected, then 100 at the proposer's usual 40%: the rounds of those
    100 that drafted."""
    controller = AdaptiveGamma(8, fixed_costs(), memory)
    for _ in range(30):
        gamma = controller.choose()
        controller.observe(gamma, 0)
    drafted = 0
    for i in range(100):
        gamma = controller.choose()
        drafted += gamma > 0
        controller.observe(gamma, min(gamma, int(i % 5 < 2)))
    return drafted


def test_a_dip_in_acceptance_does_not_switch_a_proposer_that_pays_off_for_the_rest_of_the_request():
    with_memory = _drafting_rounds_after_a_dip(_memory_of([1, 1, 0, 0, 0]))
    without = _drafting_rounds_after_a_dip(None)
    assert with_memory >= 90
    assert without < with_memory  # the control: probes at doubling intervals leave it plain for a while


def test_engine_carries_acceptance_across_requests():
    target, proposer, decoder = _auto_decoder(fixed_costs())
    params = sd.SamplingParams(max_new_tokens=60)
    decoder.generate(list(range(10)), params)
    assert decoder.acceptance_memories[""].estimate(1)[0] < 0.15
    first = list(proposer.asked)
    proposer.asked.clear()
    out = decoder.generate(list(range(3, 13)), params)
    assert out.token_ids == sd.autoregressive_generate(target, list(range(3, 13)), params).token_ids
    assert all(first[:12])  # the first request learnt that the proposer is useless in 12+ drafting rounds ...
    assert sum(k > 0 for k in proposer.asked[:12]) <= 2  # ... the second does not relearn it (a try, a probe)


def _drafting_share(price_catch_up: bool) -> float:
    """300 rounds of a proposer accepted 2 times in 5 at γ = 1, v(2) = 1, drafting 0.15 of a step, that first
    re-reads each token of a plain stretch (or the prompt's 40) at 0.1 of a step apiece (an EAGLE head's or a
    draft model's cache catching up): the share of rounds that drafted."""
    costs = PassCosts(smoothing=0.2)
    controller = AdaptiveGamma(8, costs)
    missed, drafted = 40, 0
    for i in range(300):
        gamma = min(controller.choose(), 1)
        if gamma == 0:
            costs.observe(1, 1.0, 0, 0.0)
            missed += 1
            continue
        draft_seconds = 0.15 + 0.1 * missed
        missed, drafted = 0, drafted + 1
        accepted = int(i % 5 < 2)
        controller.observe(1, accepted)
        costs.observe(2, 1.0, 1, None if controller.catching_up and not price_catch_up else draft_seconds)
    return drafted / 300


def test_catching_up_after_plain_rounds_is_not_priced_as_drafting():
    assert _drafting_share(price_catch_up=False) >= 0.9  # γ = 1 pays 1.4 / 1.15 = 1.22×
    assert _drafting_share(price_catch_up=True) < 0.5  # the control: the prompt's catch-up prices drafting at 4


@dataclass
class RecordingCosts(PassCosts):
    """A learning cost model that records what the engine tells it, (drafted, draft seconds) per round, and learns
    from synthetic times instead (v(k) = 1 + 0.05 (k - 1), c = 0.1), so its decisions do not depend on the clock."""

    calls: list[tuple[int, float | None]] = field(default_factory=list)

    def observe(
        self, verified: int, verify_seconds: float, drafted: int, draft_seconds: float | None, drafter: str = ""
    ) -> None:
        self.calls.append((drafted, draft_seconds))
        price = None if draft_seconds is None else 0.001 * drafted
        super().observe(verified, 0.01 * (1 + 0.05 * (verified - 1)), drafted, price, drafter)


def test_engine_does_not_price_drafting_in_a_round_that_follows_a_plain_one():
    costs = RecordingCosts()
    _, _, decoder = _auto_decoder(costs)
    decoder.generate(list(range(10)), sd.SamplingParams(max_new_tokens=80))
    assert costs.calls[0][0] == 0  # the calibrating plain round
    priced = 0
    for i, (drafted, draft_seconds) in enumerate(costs.calls):
        if drafted:
            assert (draft_seconds is None) == (costs.calls[i - 1][0] == 0)
            priced += draft_seconds is not None
    assert priced and any(d and s is None for d, s in costs.calls)  # both kinds of drafting round happened


def test_a_time_measured_again_after_n_rounds_keeps_a_fading_weight():
    """(1 - smoothing)^n, at least 1/2: a 2-token time last taken before a 30-round plain stretch moves halfway to a
    new one (not a fifth of the way), and one measured in consecutive rounds a fifth."""
    costs = PassCosts(smoothing=0.2)
    costs.observe(1, 0.010, 0, 0.0)
    costs.observe(2, 0.012, 1, 0.001)
    for _ in range(30):  # forward times fall by a fifth during a plain stretch
        costs.observe(1, 0.008, 0, 0.0)
    costs.observe(2, 0.0084, 1, 0.001)
    assert abs(costs.seconds[2] - 0.0102) < 1e-9  # (0.012 + 0.0084) / 2
    assert abs(costs.verify_cost(2) - 1.275) < 1e-3  # not (0.8 * 0.012 + 0.2 * 0.0084) / 0.008 = 1.41
    costs.observe(2, 0.0084, 1, 0.001)  # the next round: the usual moving average
    assert abs(costs.seconds[2] - (0.8 * 0.0102 + 0.2 * 0.0084)) < 1e-9
    costs.observe(1, 0.008, 0, 0.0)
    costs.observe(2, 0.0084, 1, 0.001)  # two rounds later: 0.8^2 kept
    assert abs(costs.seconds[2] - (0.64 * (0.8 * 0.0102 + 0.2 * 0.0084) + 0.36 * 0.0084)) < 1e-9


def _drifting_stretch(refresh_every: int) -> tuple[list[int], float]:
    """300 rounds of an always-right proposer while every forward gets slower (step 10 ms -> 13 ms, v(k) = 1 + 0.05
    (k - 1) throughout): the γ chosen each round and v(9) as the controller reads it at the end."""
    costs = PassCosts(smoothing=0.2)
    controller = AdaptiveGamma(8, costs, refresh_every=refresh_every)
    choices = []
    for i in range(300):
        gamma = controller.choose()
        choices.append(gamma)
        step = 0.010 * (1 + 0.3 * i / 300)
        costs.observe(gamma + 1, step * (1 + 0.05 * gamma), gamma, 0.0)
        controller.observe(gamma, gamma)
    return choices, costs.verify_cost(9)


def test_a_drafting_stretch_re_times_the_step_so_verify_costs_do_not_drift():
    choices, v9 = _drifting_stretch(refresh_every=32)
    plain = [i for i, gamma in enumerate(choices) if gamma == 0]
    assert plain[0] == 0 and len(plain) == 1 + (300 - 1) // 33  # the calibration, then one every 32 drafting rounds
    assert abs(v9 - 1.4) < 0.05  # the step it divides by trails the drift by a few rounds' worth
    _, stale = _drifting_stretch(refresh_every=10**9)  # the control: the step timed once, at 10 ms
    assert stale > 1.7


def _drafting_share_at(rate: float, optimism: float) -> float:
    """400 rounds of a proposer whose first guess is accepted with probability ``rate`` (seeded draws, γ <= 1,
    γ1 costing 1.21 steps: break-even at a_1 = 0.21), decoded with a decoder's memory: the share that drafted."""
    draws = random.Random(0)
    controller = AdaptiveGamma(1, fixed_costs(draft_per_token=0.16), AcceptanceHistory(), optimism=optimism)
    drafted = 0
    for _ in range(400):
        if controller.choose():
            drafted += 1
            controller.observe(1, int(draws.random() < rate))
    return drafted / 400


def test_optimism_keeps_a_paying_proposer_drafting_through_chance_dips_and_a_useless_one_off():
    assert _drafting_share_at(0.35, optimism=1.0) > _drafting_share_at(0.35, optimism=0.0) + 0.05
    assert _drafting_share_at(0.35, optimism=1.0) > 0.9
    assert _drafting_share_at(0.05, optimism=1.0) < 0.1


def test_a_lone_timing_spike_does_not_move_an_estimate_but_a_lasting_change_does():
    """Each time goes through the median of the estimate's last 3 (within RECENT_ROUNDS rounds): a forward that once
    takes 3x its usual time leaves the step where it was; a slowdown seen twice in a row moves it."""
    costs = PassCosts(smoothing=0.5)
    for _ in range(3):
        costs.observe(1, 0.010, 0, 0.0)
    costs.observe(1, 0.030, 0, 0.0)  # a lone spike: the median of (10, 10, 30) ms
    assert costs.step_seconds == 0.010
    costs.observe(2, 0.011, 1, 0.001)
    costs.observe(2, 0.033, 1, 0.001)  # two times only: the lower is taken
    assert abs(costs.seconds[2] - 0.011) < 1e-12
    for _ in range(2):
        costs.observe(1, 0.020, 0, 0.0)  # the step doubles and stays doubled
    assert costs.step_seconds > 0.012
