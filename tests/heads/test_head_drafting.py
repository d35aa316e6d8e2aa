"""The EAGLE head on the compiled kernels (``KernelHead``) against the head module run by torch ops
(``TorchHead``), and EagleProposer drafting on it: plain decoding's output, exact laws, cache resync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.kernels import needs_kernels
from helpers.models import randomized, train_word_head
from helpers.tokenizers import WORDS, word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import specdecode as sd
from specdecode import kernels as compiled
from specdecode.exactness.enumeration import engine_law, prefix_law, total_variation
from specdecode.heads.drafting import KernelHead, TorchHead, TreeRows, kernel_blocks
from specdecode.heads.model import TargetParts, lm_head_rows
from specdecode.heads.saved import load_head
from specdecode.proposers.eagle import EagleProposer

OPS = compiled.ops()
pytestmark = needs_kernels
VOCAB = 64
GREEDY = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
TOLERANCE = 0.08  # relative error of the kernels' rounding (measured 1.8-5.3%)
PROMPTS = [[3, 17, 5, 9], [60, 2, 2, 2, 7, 33, 12, 40, 8]]


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    """A random 2-layer Llama (hidden 32) with attention heads 16 wide (the kernels' smallest), vocabulary 64."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = randomized(LlamaForCausalLM(config).eval(), seed=21, weight_std=0.2)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return sd.load_model(model, tokenizer=word_tokenizer(WORDS))


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory) -> Path:
    """A head trained briefly on the target's own samples, drafting over the 56 ids it predicted most."""
    return train_word_head(target, WORDS, tmp_path_factory, "kernel-head")


def drafters(target, head_dir, bits: int) -> tuple[TorchHead, KernelHead]:
    """The kernel head, and the torch head in float32 on the weights the kernels hold (their integer blocks
    dequantized; the input norm scales folded into ``fc`` as the kernel head folds them)."""
    head, ranked, _ = load_head(head_dir, target)
    head.float()
    model = target.model
    rows = lm_head_rows(model)[ranked]
    parts = TargetParts(model, VOCAB, ranked, torch.float32, readout=False)
    kernel = KernelHead(head, parts, rows, OPS, bits, readout_bits=bits)
    with torch.no_grad():
        scales = torch.cat([head.feature_norm, head.embed_norm])
        head.fc.weight.mul_(scales)
        head.feature_norm.fill_(1.0)
        head.embed_norm.fill_(1.0)
        for param in head.parameters():
            if param.dim() == 2:
                param.copy_(kernel_blocks(param, bits).dequantize())
    parts = TargetParts(model, VOCAB, ranked, torch.float32)
    parts.lm_rows = kernel_blocks(rows, bits).dequantize()
    return TorchHead(head, parts, torch.float32), kernel


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_steps_follow_the_torch_head(target, head_dir, bits):
    """The same calls — a causal run, a truncation and re-run, a chain step, a tree level whose rows see a prefix
    and their own ancestors — give the torch head's features and logits on the same weights to the kernels'
    rounding (int8 activations, float16 keys and values: 2-5%); the control (the tree level run with the causal
    mask instead) misses the rows it changes by several times more."""
    dense, kernel = drafters(target, head_dir, bits)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(12, 32, generator=generator) * 30
    tokens = torch.randint(0, VOCAB, (12,), generator=generator).tolist()

    def both(*args, read_from=0):
        return [d.step(*args, read_from=read_from) for d in (dense, kernel)]

    checks = [both(features, tokens, list(range(12)), None, read_from=11)]
    for drafter in (dense, kernel):
        drafter.truncate(9)
    checks.append(both(features[9:], tokens[9:], [9, 10, 11], None))
    (out, _), _ = checks[-1]
    checks.append(both(out[-1:], tokens[:1], [12], None))
    assert dense.length == kernel.length == 13
    # a tree level: rows at slots 13..15 see slots 0..11, rows 0 and 1 also slot 12, each row itself
    level = (out[-3:], tokens[3:6], [13, 13, 12], TreeRows(12, [[12, 13], [12, 14], [15]]))
    checks.append(both(*level))
    for (dense_out, dense_logits), (kernel_out, kernel_logits) in checks:
        assert relative_error(kernel_out, dense_out) < TOLERANCE
        assert relative_error(kernel_logits, dense_logits) < TOLERANCE
    for drafter in (dense, kernel):
        drafter.truncate(13)
    wrong, _ = kernel.step(*level[:3], None)  # the control: causal over the three rows
    (dense_out, _), (kernel_out, _) = checks[-1]
    for row in (1, 2):  # the rows that see other slots under the causal mask (measured 3-23% off, against 1-2%)
        assert relative_error(wrong[row], dense_out[row]) > 3 * relative_error(kernel_out[row], dense_out[row])


def test_embedding_rows_are_the_targets_inside_and_outside_the_drafting_vocabulary(target, head_dir):
    """A step's embedding rows come from the drafting vocabulary's table, looked up once, or from the bounded memo
    of other tokens: either way the target's own rows."""
    _, kernel = drafters(target, head_dir, 8)
    inside = kernel.parts.draft_vocab[:3].tolist()
    outside = sorted(set(range(VOCAB)) - set(kernel.parts.draft_vocab.tolist()))[:2]
    assert outside, "the head drafts from part of the vocabulary"
    for ids in (inside + outside, outside + inside, list(range(VOCAB))):
        assert torch.equal(kernel._embed(ids), kernel.parts.embed(torch.tensor(ids)).float())


@pytest.mark.parametrize("bits", [8, 4])
def test_blocks_round_each_group_to_its_own_float16_scale(bits):
    """Each block's step is the finest float16 one that covers it (max|w| / 127 for 8 bits; for 4, (max − m) / 15
    from the block's minimum m in float16) and every weight is within half a step (plus m's rounding)."""
    weight = torch.randn(48, 64) * torch.logspace(-3, 1, 64)  # blocks of very different sizes
    blocks = kernel_blocks(weight, bits)
    assert blocks.scale.shape == (48, 2) and blocks.half_scales
    assert torch.equal(blocks.scale.half().float(), blocks.scale)
    groups = weight.view(48, 2, 32)
    if bits == 8:
        step = groups.abs().amax(-1) / 127
        slack = torch.zeros(48, 2)
    else:
        step = (groups.amax(-1) - groups.amin(-1).half().float()) / 15  # from the block's float16 minimum
        slack = groups.amin(-1).abs() * 2**-11
    assert (blocks.scale >= step).all() and (blocks.scale <= step * (1 + 2**-9)).all()
    error = (blocks.dequantize() - weight).abs().view(48, 2, 32)
    assert (error <= (blocks.scale / 2 + slack)[..., None] * (1 + 1e-5) + 1e-8).all()


@pytest.mark.parametrize(
    ("tree_nodes", "bits"), [(None, (8, 4)), (4, (8, 4)), (9, (8, 4)), (None, (4, 8)), (4, (8, 8))]
)
def test_greedy_output_equals_plain_decoding(target, head_dir, tree_nodes, bits):
    proposer = EagleProposer(target, head=head_dir, tree_nodes=tree_nodes, weight_bits=bits[0], readout_bits=bits[1])
    assert isinstance(proposer.drafter, KernelHead)
    accepted = 0
    for prompt in PROMPTS:
        out = sd.SpeculativeDecoder(target, proposer, gamma=4).generate(prompt, GREEDY)
        assert out.token_ids == sd.autoregressive_generate(target, prompt, GREEDY).token_ids
        accepted += out.stats.accepted
    assert accepted > 0


@pytest.mark.parametrize("tree_nodes", [None, 5])
def test_cache_resync_after_partial_acceptance_matches_a_fresh_proposer(target, head_dir, tree_nodes):
    """Rounds that keep 0, 1 or 2 guesses then a target token: a long-lived proposer's drafts are bitwise those
    of a fresh one that computes its whole cache in one call (the kernels are row-invariant)."""
    context = list(PROMPTS[0])
    runner = target.new_runner()
    runner.capture_hidden = True
    runner.prefill(torch.tensor(context[:-1]))
    features = [runner.hidden]
    warm = EagleProposer(target, head=head_dir, tree_nodes=tree_nodes, kernels=True)
    sampled = sd.SamplingParams(temperature=1.0)
    for round_ in range(9):
        warm.observe_target(features)
        draft = warm.propose(context, 4, GREEDY, torch.Generator())
        fresh = EagleProposer(target, head=head_dir, tree_nodes=tree_nodes, kernels=True)
        fresh.observe_target(list(features))
        assert torch.equal(fresh.propose(context, 4, GREEDY, torch.Generator()).tokens, draft.tokens)
        a = warm.propose(context, 4, sampled, torch.Generator().manual_seed(round_))
        b = fresh.propose(context, 4, sampled, torch.Generator().manual_seed(round_))
        assert torch.equal(a.tokens, b.tokens)
        assert (a.probs is None) == (b.probs is None) and (a.probs is None or torch.equal(a.probs, b.probs))
        chain = draft.tokens if draft.parents is None else draft.tokens[first_path(draft.parents.tolist())]
        logits = runner.forward(torch.cat([torch.tensor(context[-1:]), chain]))
        n = min(round_ % 3, len(chain))
        features.append(runner.hidden[: n + 1])
        context += chain[:n].tolist() + [int(logits[n].argmax())]
        runner.rollback_to(len(context) - 1)


def first_path(parents: list[int]) -> list[int]:
    """A tree's first root-to-leaf path: node 0, then each node's first child."""
    path = [0]
    while path[-1] in parents:
        path.append(parents.index(path[-1]))
    return path


ENUMERATED = sd.SamplingParams(temperature=0.8, top_k=4, max_new_tokens=4)


@pytest.mark.parametrize("tree_nodes", [None, 4])
def test_kernel_drafted_laws_enumerated_exactly(target, head_dir, tree_nodes):
    """The engine's exact law of the first two tokens with the kernel head drafting (every decision enumerated)
    is the target's to float32 rounding: drafting numerics change acceptance, never the law."""
    # an 8-bit read-out: on this tiny head a 4-bit one leaves the tree no accepted mass to check
    proposer = EagleProposer(target, head=head_dir, tree_nodes=tree_nodes, kernels=True, readout_bits=8)
    decoder = sd.SpeculativeDecoder(target, proposer, gamma=3 if tree_nodes else 1)
    result = engine_law(decoder, PROMPTS[0], ENUMERATED, tokens=2)
    tv = total_variation(result.law, prefix_law(target, PROMPTS[0], ENUMERATED, tokens=2))
    assert result.accepted_mass > 0.1, result.accepted_mass
    assert tv < 1e-6, tv


def test_without_the_kernels_torch_runs_the_head(target, head_dir, monkeypatch):
    assert isinstance(EagleProposer(target, head=head_dir).drafter, KernelHead)  # the default where they built
    assert isinstance(EagleProposer(target, head=head_dir, kernels=False).drafter, TorchHead)
    assert isinstance(EagleProposer(target, head=head_dir, int8=False, dtype=torch.float32).drafter, TorchHead)
    with pytest.raises(ValueError, match="int8=True"):
        EagleProposer(target, head=head_dir, kernels=True, int8=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight_bits"):
        EagleProposer(target, head=head_dir, weight_bits=6)
    monkeypatch.setattr(compiled, "ops", lambda variant=None: None)
    assert isinstance(EagleProposer(target, head=head_dir).drafter, TorchHead)
    with pytest.raises(ValueError, match="kernels=True"):
        EagleProposer(target, head=head_dir, kernels=True)
