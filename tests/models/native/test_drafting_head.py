"""The drafting head (``DraftingHead``, ``DraftModelProposer(vocabulary=N)``): the kept logits are bitwise the full
head's, the extras are their exact rows', every other logit is −inf; greedy output is the target's token for token;
sampled output follows the target's law exactly, enumerated through the compiled chain, where a draft that
misstates the q it sampled from is caught."""

from __future__ import annotations

import pytest
import torch
from helpers.enumeration import BOUND
from helpers.gguf import LAYOUTS, write_gguf
from helpers.kernels import kernels_or_skip

import specdecode as sd
from specdecode.exactness.enumeration import engine_law, prefix_law, total_variation
from specdecode.models.native.drafting_head import DraftingHead
from specdecode.proposers import draft_model

pytestmark = pytest.mark.needs_kernels

KEEP = 40  # of the tiny files' 96 token ids
PROMPT = [3, 17, 55, 8, 71, 29]  # 55 and 71 lie past KEEP: extras once seen


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    kernels_or_skip()
    folder = tmp_path_factory.mktemp("drafting")
    return write_gguf(folder / "draft.gguf", LAYOUTS["mixed"]), write_gguf(folder / "target.gguf", LAYOUTS["k-quants"])


@pytest.fixture(scope="module")
def draft(files) -> sd.LoadedModel:
    return sd.load_model(files[0])


@pytest.fixture(scope="module")
def target(files) -> sd.LoadedModel:
    return sd.load_model(files[1])


def _hidden(model: sd.LoadedModel, ids: list[int]) -> tuple[torch.Tensor, object]:
    runner = model.new_runner()
    runner.capture_hidden = True
    runner.prefill(torch.tensor(ids))
    return runner.hidden, runner.decoder


def test_kept_logits_are_the_full_heads_bitwise_extras_exact_the_rest_minus_infinity(draft):
    hidden, decoder = _hidden(draft, PROMPT)
    head = DraftingHead(decoder, KEEP, always=[90])
    head.use(PROMPT)
    logits = head.logits(hidden)
    full = decoder.lm_head.handle  # the full head, unrefined: what a kept logit must equal bitwise
    unrefined = full.kernels.lm_head(hidden, decoder.norm, decoder.eps, [full.id], 96, None, None, 0, False)
    assert torch.equal(logits[:, :KEEP], unrefined[:, :KEEP])
    extras = [55, 71, 90]
    assert head.extras == len(extras)
    x = hidden.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + decoder.eps) * decoder.norm.float()
    exact = normed @ decoder.exact_head_rows(torch.tensor(extras)).T
    torch.testing.assert_close(logits[:, extras], exact, rtol=0, atol=0)
    torch.testing.assert_close(logits[:, extras], unrefined[:, extras], rtol=1e-3, atol=1e-3)  # the same head
    rest = torch.ones(draft.vocab_size, dtype=torch.bool)
    rest[:KEEP] = False
    rest[extras] = False
    assert torch.isinf(logits[:, rest]).all() and (logits[:, rest] < 0).all()


def test_greedy_output_is_the_targets_token_for_token(draft, target):
    params = sd.SamplingParams(temperature=0, max_new_tokens=24)
    plain = sd.autoregressive_generate(target, PROMPT, params).token_ids
    for model in (draft, target):  # the target drafting for itself: accepted unless its argmax lies past the cut
        proposer = sd.DraftModelProposer(model, vocabulary=KEEP)
        out = sd.SpeculativeDecoder(target, proposer, gamma=3).generate(PROMPT, params)
        assert out.token_ids == plain
    assert out.stats.accepted > 0


class MisstatedCut(sd.DraftModelProposer):
    """WRONG (the control): guesses sampled from the cut head's q, reported to the verifier as q with 10% of its mass
    spread evenly over its own support (the kept and seen tokens): not the law the guesses came from."""

    def propose(self, context, k, params, generator):
        draft = super().propose(context, k, params, generator)
        support = (draft.probs > 0).float()
        even = support / support.sum(-1, keepdim=True)
        return sd.Draft(draft.tokens, 0.9 * draft.probs + 0.1 * even, draft.parents)


@pytest.mark.parametrize("kind", ["cut", "misstated-cut-control"])
def test_sampled_law_is_the_targets_through_the_compiled_chain(target, kind):
    params = sd.SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4)  # top-3 of 96: enumerable
    # the target drafting for itself through the cut: q is p on the kept and seen tokens, 0 past the cut
    proposer = (sd.DraftModelProposer if kind == "cut" else MisstatedCut)(target, vocabulary=KEEP)
    decoder = sd.SpeculativeDecoder(target, proposer, gamma=1)
    result = engine_law(decoder, PROMPT, params, tokens=2, through_kernels=True)
    tv = total_variation(result.law, prefix_law(target, PROMPT, params, tokens=2))
    assert result.runs > 10 and result.accepted_mass > 0.05, (result.runs, result.accepted_mass)
    if kind == "cut":
        assert tv < BOUND, tv
    else:
        assert tv > 100 * BOUND, tv


def test_vocabulary_choices_and_their_errors(draft, monkeypatch):
    assert sd.DraftModelProposer(draft).head is None  # auto: 96 tokens are no more than 1.5 × DRAFTING_VOCABULARY
    assert sd.DraftModelProposer(draft, vocabulary=None).head is None
    assert sd.DraftModelProposer(draft, vocabulary=KEEP).head.keep == KEEP
    monkeypatch.setattr(draft_model, "DRAFTING_VOCABULARY", 70)  # 96 is no more than 1.5 × 70: auto keeps all
    assert sd.DraftModelProposer(draft).head is None
    monkeypatch.setattr(draft_model, "DRAFTING_VOCABULARY", KEEP)  # 96 > 1.5 × 40: auto cuts to 40
    assert sd.DraftModelProposer(draft).head.keep == KEEP
    for bad, message in [("all", "a number of tokens"), (True, "a number of tokens"), (0, "1..95"), (96, "1..95")]:
        with pytest.raises(ValueError, match=message):
            sd.DraftModelProposer(draft, vocabulary=bad)
