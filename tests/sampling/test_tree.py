"""Token trees through the engine: structure helpers, greedy and reproducible identity, exactness, stats.

Identity tests compare token for token with plain decoding (``autoregressive_generate``) on both runners,
with trees whose nodes the target partly accepts and partly rejects. The exactness tests sample the first two
tokens SAMPLES times per case with ``check_exactness`` (chi-square of the first token and of the two-token
joint against the target's enumerated law, Bonferroni inside each call); each call runs at family
false-alarm rate ALPHA / CASES with CASES = 10 calls (5 tree drafts × 2 runners) that must pass, so the chance
that a correct engine fails any for freshly chosen seeds is ≤ ALPHA = 1%. The negative controls run the
same check on biased tree rules and must fail it at the same threshold.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from helpers.laws import biased_tree_sample
from helpers.models import SMALL_VOCAB, with_eos
from helpers.trees import EXACT_PROMPT, T1, TreeProposer, draw_tree, informed_table, random_tables

import specdecode as sd
import specdecode.engine.decoder
from specdecode.exactness.check import check_exactness
from specdecode.sampling.tree import attention_mask, children, depths, prune_depth

# ------------------------------------------------------------------------------------------- structure
#        root ─┬─ 0 ─── 2 ─── 4
#              └─ 1 ─── 3
PARENTS = torch.tensor([-1, -1, 0, 1, 2])


def test_children_depths_and_mask():
    assert children(PARENTS) == [[0, 1], [2], [3], [4], [], []]
    assert depths(PARENTS).tolist() == [1, 1, 2, 2, 3]
    mask = attention_mask(PARENTS, cached=2)
    assert mask.shape == (6, 8) and mask[:, :2].all()
    tree = mask[:, 2:].int().tolist()
    assert tree == [
        [1, 0, 0, 0, 0, 0],  # the root (the newest context token)
        [1, 1, 0, 0, 0, 0],  # node 0
        [1, 0, 1, 0, 0, 0],  # node 1
        [1, 1, 0, 1, 0, 0],  # node 2: root, 0, itself
        [1, 0, 1, 0, 1, 0],  # node 3: root, 1, itself
        [1, 1, 0, 1, 0, 1],  # node 4: root, 0, 2, itself
    ]
    with pytest.raises(ValueError, match="parents"):
        children(torch.tensor([-1, 1]))


def test_prune_depth_renumbers_and_keeps_probs():
    probs = torch.eye(5, 8, dtype=torch.float64)
    draft = sd.Draft(torch.tensor([10, 11, 12, 13, 14]), probs, PARENTS)
    pruned = prune_depth(draft, 2)
    assert pruned.tokens.tolist() == [10, 11, 12, 13] and pruned.parents.tolist() == [-1, -1, 0, 1]
    assert torch.equal(pruned.probs, probs[:4])
    star = prune_depth(sd.Draft(torch.tensor([5, 6, 7, 8]), None, torch.tensor([-1, 0, -1, 2])), 1)
    assert star.tokens.tolist() == [5, 7] and star.parents.tolist() == [-1, -1] and star.is_tree
    assert prune_depth(draft, 3) is draft
    assert len(prune_depth(draft, 0)) == 0


def test_tree_stats_count_nodes_per_depth_and_merge():
    stats = sd.DecodeStats()
    stats.record_tree_round([2, 3], accepted=1, rejected=True)  # depth 1 accepted, depth 2 tested and failed
    stats.record_round(2, 2)
    assert (stats.rounds, stats.tree_rounds, stats.drafted, stats.accepted, stats.rejections) == (2, 1, 7, 3, 1)
    assert stats.per_position == [2, 1] and stats.per_position_reached == [2, 2]
    assert stats.per_depth_drafted == [3, 4]
    assert stats.drafted_per_round == 3.5 and stats.accepted_per_round == 1.5
    leaf = sd.DecodeStats()
    leaf.record_tree_round([2, 2, 1], accepted=3, rejected=False, sibling_accepts=2)  # a leaf: nothing rejected
    assert leaf.per_position_reached == [1, 1, 1] and leaf.rejections == 0
    both = stats.merge(leaf)
    assert both.per_depth_drafted == [5, 6, 1] and both.tree_rounds == 2 and both.per_position == [3, 2, 1]
    assert both.sibling_accepts == 2 and both.to_dict()["sibling_accepts"] == 2
    data = both.to_dict()
    assert data["per_depth_drafted"] == [5, 6, 1] and data["drafted_per_round"] == 4.0


# ------------------------------------------------------------------------------------------- identity

PROMPT = [5, 17, 33, 5, 17, 2, 60, 41]
SHAPES = {"chain": (1, 1, 1, 1), "star": (4,), "deep-wide": (3, 2, 2, 1)}


class OracleTreeProposer:
    """Deterministic random trees (``draw_tree``, point masses) in which, at each level with probability
    ``hit``, one child on the path carries the reference output's next token: the target accepts paths of
    random depth through any sibling position and rejects the rest."""

    def __init__(self, widths, reference: list[int], vocab_size: int, hit: float = 0.75, seed: int = 0) -> None:
        self.widths = widths
        self.reference = reference
        self.table = random_tables(len(widths), vocab_size, seed)
        self.hit = hit
        self.rng = random.Random(seed)

    def propose(self, context, k, params, generator):
        draft = draw_tree(self.widths, self.table, context[-1], generator, sampled=False)
        tokens, kids = draft.tokens.clone(), children(draft.parents)
        assert context == self.reference[: len(context)], "identity broke before this round"
        row, t = 0, len(context)
        while kids[row] and t < len(self.reference) and self.rng.random() < self.hit:
            want = self.reference[t]
            match = [node for node in kids[row] if tokens[node] == want]
            node = match[0] if match else self.rng.choice(kids[row])
            tokens[node] = want  # siblings stay distinct: `want` was not among them
            row, t = node + 1, t + 1
        return sd.Draft(tokens, None, draft.parents)


@pytest.mark.parametrize("gamma", [2, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_tree_output_is_plain_decoding(large_target, shape, gamma):
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
    proposer = OracleTreeProposer(SHAPES[shape], PROMPT + plain, large_target.vocab_size)
    out = sd.SpeculativeDecoder(large_target, proposer, gamma=gamma).generate(PROMPT, params)
    assert out.token_ids == plain
    s = out.stats
    assert s.accepted > 0 and s.rejections > 0 and s.rounds < 40
    assert len(s.per_depth_drafted) <= gamma  # pruned to depth gamma
    assert (s.tree_rounds > 0) == (shape != "chain")  # a chain keeps the chain path
    if SHAPES[shape][0] > 1:  # the oracle puts the wanted token under any child: later siblings win too
        assert s.sibling_accepts > 0
    assert s.generated == s.accepted + s.rounds and sum(s.per_position) == s.accepted
    assert sum(s.per_depth_drafted) == s.drafted


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
def test_trees_never_draft_past_the_budget(large_target, max_new_tokens):
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
    proposer = OracleTreeProposer(SHAPES["deep-wide"], PROMPT + plain, large_target.vocab_size, hit=1.0)
    out = sd.SpeculativeDecoder(large_target, proposer, gamma=4).generate(PROMPT, params)
    assert out.token_ids == plain and out.finish_reason == "length"
    assert len(out.stats.per_depth_drafted) <= max_new_tokens - 1


def test_eos_inside_an_accepted_tree_path_stops_there(large_target):
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
    firsts: dict[int, int] = {}
    for i, token in enumerate(plain):
        firsts.setdefault(token, i)
    for eos, i in list(firsts.items())[1:6]:
        target = with_eos(large_target, eos)
        proposer = OracleTreeProposer(SHAPES["deep-wide"], PROMPT + plain, large_target.vocab_size, hit=1.0)
        out = sd.SpeculativeDecoder(target, proposer, gamma=4).generate(PROMPT, params)
        assert out.token_ids == plain[: i + 1] and out.finish_reason == "eos"


def test_one_token_prompt_and_prompt_lookup_trees(large_target):
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=30)
    for prompt in ([9], PROMPT + PROMPT):
        plain = sd.autoregressive_generate(large_target, prompt, params).token_ids
        proposer = OracleTreeProposer(SHAPES["star"], prompt + plain, large_target.vocab_size)
        assert sd.SpeculativeDecoder(large_target, proposer, gamma=3).generate(prompt, params).token_ids == plain
        lookup = sd.PromptLookupProposer(branches=3)
        out = sd.SpeculativeDecoder(large_target, lookup, gamma=4).generate(prompt, params)
        assert out.token_ids == plain


@pytest.mark.parametrize("warp", [(1.0, 0, 1.0), (0.8, 8, 0.9)], ids=["T1", "T0.8-k8-p0.9"])
@pytest.mark.parametrize("shape", ["star", "deep-wide"])
def test_reproducible_tree_output_is_plain_sampling(large_target, shape, warp):
    temperature, top_k, top_p = warp
    for seed in (0, 2**40 + 3):
        params = sd.SamplingParams(temperature, top_k, top_p, max_new_tokens=30, seed=seed)
        plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
        proposer = OracleTreeProposer(SHAPES[shape], PROMPT + plain, large_target.vocab_size, seed=seed)
        decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=4, mode="reproducible")
        out = decoder.generate(PROMPT, params)
        assert out.token_ids == plain
        assert out.stats.tree_rounds > 0 and out.stats.accepted > 0 and out.stats.rejections > 0
        assert out.stats.sibling_accepts > 0


def test_adaptive_gamma_with_trees_keeps_identity(large_target):
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
    plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
    proposer = OracleTreeProposer(SHAPES["deep-wide"], PROMPT + plain, large_target.vocab_size)
    out = sd.SpeculativeDecoder(large_target, proposer, gamma="auto").generate(PROMPT, params)
    assert out.token_ids == plain


# ------------------------------------------------------------------------------------------- exactness

ALPHA = 0.01
CASES = 10
SAMPLES = 800
TREES = {"star": (4,), "deep-wide": (3, 2)}


def exactness_report(target: sd.LoadedModel, case: str):
    """``check_exactness`` of one case: a tree shape, its draft tables (informed or random), sampled or not."""
    shape, tables, kind = case.split("/")
    widths = TREES[shape]
    if tables == "informed":
        table = informed_table(target, widths)
    else:  # peaked random q that ignores the target: rejections and residual draws dominate
        table = random_tables(len(widths), SMALL_VOCAB, seed=1, concentration=0.3)
    proposer = TreeProposer(widths, table, sampled=kind == "sampled")
    return check_exactness(
        target, proposer, [EXACT_PROMPT], T1, samples=SAMPLES, gamma=len(widths), alpha=ALPHA / CASES
    )


EXACT_CASES = [
    "star/informed/sampled",
    "star/informed/point-masses",
    "deep-wide/informed/sampled",
    "deep-wide/informed/point-masses",
    "star/random/sampled",
]


@pytest.mark.parametrize("case", EXACT_CASES)
def test_tree_sampling_follows_the_target_exactly(small_target, case):
    report = exactness_report(small_target, case)
    assert report.passed, report.verdict
    assert report.accepted > SAMPLES / 4  # both the accept and the reject paths ran
    assert report.tree_rounds >= SAMPLES  # every sample's first round verified a tree
    assert report.sibling_accepts > SAMPLES / 50  # and later siblings were kept (the residual path of a tree)


@pytest.mark.parametrize("bug", ["update_residual", "remove_tried"])
def test_negative_control_a_biased_tree_rule_is_caught(small_target, monkeypatch, bug):
    biased = functools.partial(biased_tree_sample, **{bug: False})
    monkeypatch.setattr(specdecode.engine.decoder, "tree_speculative_sample", biased)
    report = exactness_report(small_target, "star/random/sampled")
    assert not report.passed, report.verdict
