"""The exact-law tests' shared cases: the point-mass laws every path enumerates (``case``), the draft tables, the
bound a float32 law leaves, and the control that mixes each residual with the target's own law."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import specdecode as sd
import specdecode.sampling.verify
from helpers.kernels import use_build
from helpers.models import SMALL_VOCAB
from helpers.trees import TreeProposer, random_tables
from specdecode.exactness.enumeration import EngineLaw, engine_law, prefix_law, total_variation
from specdecode.proposers.suffix import SuffixHistory, SuffixProposer
from specdecode.sampling.params import SamplingParams

BOUND = 1e-6  # TV left by float32 target probs: ~2e-8 measured

MIXED = 0.01  # the controls: every residual after a rejection mixed 1% with the target's own law

LOOKUP_PROMPT = [7, 4, 1, 7, 4, 1, 7, 4]

BRANCHING_PROMPT = [7, 4, 3, 7, 4, 12, 7, 4, 13, 9, 7, 4]  # "7 4" went on three ways: three branches

SUFFIX_PROMPT = [3, 9, 4]

T1 = sd.SamplingParams(temperature=1.0, max_new_tokens=4)


def suffix_history(target: sd.LoadedModel) -> SuffixHistory:
    """Twelve of the target's own continuations of SUFFIX_PROMPT: point-mass siblings at several depths, often
    accepted."""
    history = SuffixHistory()
    for seed in range(12):
        params = sd.SamplingParams(temperature=1.0, max_new_tokens=3, seed=seed)
        history.add([*SUFFIX_PROMPT, *sd.autoregressive_generate(target, SUFFIX_PROMPT, params).token_ids])
    return history


def guided_tables(target: sd.LoadedModel, depth: int, seed: int) -> torch.Tensor:
    """Draft tables half random, half the target's law after (1, 2, 3, t) for parent token t: guesses the target
    often accepts and often rejects."""
    table = random_tables(depth, SMALL_VOCAB, seed)
    runner = target.new_runner()
    for parent in range(SMALL_VOCAB):
        runner.reset()
        logits = runner.forward(torch.tensor([1, 2, 3, parent]))[-1]
        table[:, parent] = (table[:, parent] + torch.softmax(logits.double(), -1)) / 2
    return table


def case(name: str, target: sd.LoadedModel) -> tuple[sd.SpeculativeDecoder, list[int]]:
    """(decoder, prompt) of one point-mass law."""
    proposer, prompt, gamma = {
        "chain/lookup": (sd.PromptLookupProposer(), LOOKUP_PROMPT, 2),
        "tree/lookup-3-branches": (sd.PromptLookupProposer(branches=3), BRANCHING_PROMPT, 3),
        "tree/deep-wide-3-2": (TreeProposer((3, 2), guided_tables(target, 2, 1), sampled=False), [1, 2, 3], 2),
        "tree/depth-3": (TreeProposer((2, 2, 2), guided_tables(target, 3, 2), sampled=False), [1, 2, 3], 3),
        # remember=False: the runs must not teach the proposer (a remembering one adds every run to its history)
        "tree/suffix": (SuffixProposer(suffix_history(target), tree_nodes=8, remember=False), SUFFIX_PROMPT, 3),
    }[name]
    return sd.SpeculativeDecoder(target, proposer, gamma=gamma), prompt


def residual_mixed_with_p(ops, share: float):
    """The real ops with exact_chain's draw after a rejection taken from (1 − share) · residual + share · p: at draw
    uniform u < share from p (at u / share), else from the residual (at the rest of u) — the law a mutant build that
    mixes p into the residual draws (also the strong tier's chain control: tests/exactness/test_check_strong.py)."""

    def exact_chain(p, q, x, a, u):
        n, _ = ops.exact_chain(p, q, x, a, 0.0)
        if n == len(x):
            return ops.exact_chain(p, q, x, a, u)
        if u < share:
            return [n, int(ops.inverse_cdf_rows(p[n : n + 1], torch.tensor([u / share], dtype=torch.float64)))]
        return ops.exact_chain(p, q, x, a, (u - share) / (1 - share))

    return SimpleNamespace(exact_chain=exact_chain, inverse_cdf_rows=ops.inverse_cdf_rows)


# Top-2 sampling keeps each draw to two branches, so a γ = 3 chain's two-token law is a few dozen engine runs
TOP2 = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=4)  # max_new_tokens 4: the first round drafts γ ≤ 3

LAW_PROMPT = [7, 4, 1, 7, 4, 1, 7, 4]

LAW_BOUND = 1e-6  # as tests/exactness/test_enumeration.py: float32 target probabilities leave ~1e-8


def enumerated_tv(decoder: sd.SpeculativeDecoder, variant: str, monkeypatch) -> tuple[float, EngineLaw]:
    """TV between the engine's law of its first two tokens — enumerated exactly through the compiled sampling ops
    (``engine_law(through_kernels=True)``, tests/exactness/test_enumeration_kernels.py) of build ``variant`` — and the
    target's; and the engine law."""
    use_build(variant, monkeypatch)
    result = engine_law(decoder, LAW_PROMPT, TOP2, tokens=2, through_kernels=True)
    return total_variation(result.law, prefix_law(decoder.target, LAW_PROMPT, TOP2, tokens=2)), result
