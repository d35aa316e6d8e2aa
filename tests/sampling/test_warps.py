"""The warps OpenAI clients send — presence, frequency and repetition penalties, logit_bias, min-p — keep speculative
decoding exact: every verified row is warped with the counts of its own context (accepted draft tokens included).

Laws: the engine's law of its first two tokens, every random decision enumerated (``enumeration.engine_law``), equals
the law of plain sampling with each warp written out naively here (a loop over the context's tokens, not the
production code) to 1e-6 in total variation, chain and tree. Controls, each of which must miss by ≥ 100× the bound:
each row penalised with its context one token short (the row's own draft token left out: "one row late"); the warps
applied to the first row only; min-p applied before temperature. Greedy: speculative output equals plain decoding
token for token with each warp, and so does reproducible mode at T > 0 with a fixed seed.
"""

from __future__ import annotations

import pytest
import torch
from helpers.enumeration import BOUND, LOOKUP_PROMPT, guided_tables
from helpers.kernels import use_build
from helpers.laws import plain_law
from helpers.models import SMALL_VOCAB, tiny_llama
from helpers.trees import TreeProposer

import specdecode as sd
import specdecode.engine.decoder
import specdecode.engine.request
import specdecode.sampling.warps
from specdecode.exactness.check import target_law
from specdecode.exactness.enumeration import engine_law, total_variation
from specdecode.sampling.warps import RowContexts, target_logits

BIAS = {4: 2.5, 1: -1.5, 9: 1.0}
LAW_WARPS = {
    "presence": sd.SamplingParams(temperature=1.0, presence_penalty=2.0, max_new_tokens=4),
    "frequency": sd.SamplingParams(temperature=1.0, frequency_penalty=-1.5, max_new_tokens=4),
    "repetition": sd.SamplingParams(temperature=1.0, repetition_penalty=1.5, max_new_tokens=4),
    "logit_bias": sd.SamplingParams(temperature=1.0, logit_bias=BIAS, max_new_tokens=4),
    "min_p": sd.SamplingParams(temperature=0.7, min_p=0.08, max_new_tokens=4),
    "all": sd.SamplingParams(
        temperature=0.9,
        top_k=8,
        min_p=0.02,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        repetition_penalty=1.4,
        logit_bias=BIAS,
        max_new_tokens=4,
    ),
}
CONTEXT_WARPS = ("presence", "frequency", "repetition", "all")  # those that read the context


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return sd.load_model(tiny_llama(SMALL_VOCAB, seed=0))


def naive_warp(logits: torch.Tensor, params: sd.SamplingParams, prompt: list[int], generated: list[int]):
    """The reference: logit_bias, repetition, frequency, presence, token by token over a copy of ``logits`` [V]."""
    out = logits.float().clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(generated):
        r = params.repetition_penalty
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token in set(generated):
        out[token] -= params.frequency_penalty * generated.count(token)
        out[token] -= params.presence_penalty
    return out


def reference_law(target: sd.LoadedModel, prompt: list[int], params: sd.SamplingParams, tokens: int = 2):
    """Plain sampling's law of the first ``tokens`` tokens, each step warped by ``naive_warp`` after its prefix."""
    return plain_law(
        target,
        prompt,
        tokens,
        lambda logits, prefix: target_law(naive_warp(logits, params, prompt, list(prefix)), params),
    )


def law_case(name: str, target: sd.LoadedModel) -> tuple[sd.SpeculativeDecoder, list[int]]:
    if name == "chain/lookup":
        return sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=2), LOOKUP_PROMPT
    proposer = TreeProposer((3, 2), guided_tables(target, 2, 1), sampled=False)
    return sd.SpeculativeDecoder(target, proposer, gamma=2), [1, 2, 3]


def one_row_late(self: RowContexts) -> torch.Tensor:
    """WRONG (a control): each row's context without its own draft token (the counts one row late)."""
    paths = ORIGINAL_PATHS(self).clone()
    nodes = torch.arange(len(self.draft_tokens))
    paths[nodes + 1, nodes] = False
    return paths


ORIGINAL_PATHS = RowContexts.paths


def first_row_only(logits, params, rows):
    """WRONG (a control): the context warps applied to row 0 only, draft rows left raw."""
    warped = logits.float().clone()
    warped[:1] = target_logits(logits[:1], params, dataclass_first_row(rows))
    return warped


def dataclass_first_row(rows: RowContexts) -> RowContexts:
    return RowContexts(rows.context, rows.prompt_len, torch.zeros(0, dtype=torch.int64))


def min_p_before_temperature(logits, params):
    """WRONG (a control): min-p measured on the logits before temperature."""
    kept = sd.sampling.warp_logits(logits, 1.0, 0, 1.0, params.min_p)
    return torch.softmax(sd.sampling.warp_logits(kept, params.temperature, params.top_k, params.top_p), dim=-1)


CONTROLS = {
    "one-row-late": lambda mp: mp.setattr(specdecode.sampling.warps.RowContexts, "paths", one_row_late),
    "first-row-only": lambda mp: mp.setattr(specdecode.engine.request, "target_logits", first_row_only),
    "min-p-before-temperature": lambda mp: mp.setattr(
        specdecode.engine.decoder, "probs_from_logits", min_p_before_temperature
    ),
}


def applies(control: str, warp: str, name: str) -> bool:
    if control == "one-row-late":  # prompt lookup guesses prompt tokens: seen already, whatever the row
        return warp in CONTEXT_WARPS and (warp, name) != ("repetition", "chain/lookup")
    if control == "first-row-only":
        return warp != "min_p"
    return control == "none" or warp == "min_p"


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("control", ["none", *CONTROLS])
@pytest.mark.parametrize("warp", list(LAW_WARPS))
@pytest.mark.parametrize("name", ["chain/lookup", "tree/deep-wide-3-2"])
def test_warped_laws_are_plain_samplings_exactly(target, name, warp, control, path, monkeypatch):
    """Proves each warp keeps the engine's law of the first two tokens that of plain sampling with the warp (written
    out naively) to 1e-6, chain and tree, on the torch verification path and through the compiled ops a float32 CPU
    request runs (the warps are torch code before either: each control reaches both); each control must miss by
    ≥ 100× the bound."""
    if not applies(control, warp, name):
        pytest.skip("the control does not change this warp")
    if path == "kernels":
        use_build("native", monkeypatch)
    params = LAW_WARPS[warp]
    if control != "none":
        CONTROLS[control](monkeypatch)
    decoder, prompt = law_case(name, target)
    result = engine_law(decoder, prompt, params, tokens=2, through_kernels=path == "kernels")
    tv = total_variation(result.law, reference_law(target, prompt, params))
    assert result.runs > 1 and result.accepted_mass > 0.05, result
    if control == "none":
        assert tv < BOUND, (name, warp, tv, result.runs)
    else:
        assert tv > 100 * BOUND, (name, warp, control, tv)


@pytest.mark.parametrize("parents", [None, torch.tensor([-1, 0, 0, -1, 3])], ids=["chain", "tree"])
def test_each_row_is_warped_with_its_own_context(parents):
    """The vectorised rows equal the naive warp of each row's context (prompt, generated, the path's draft tokens)."""
    gen = torch.Generator().manual_seed(0)
    prompt, generated = [1, 2, 3, 2], [5, 6, 5]
    draft = torch.tensor([5, 7, 2, 6, 6]) if parents is not None else torch.tensor([5, 7, 7, 1])
    logits = torch.randn(len(draft) + 1, 12, generator=gen) * 3
    params = LAW_WARPS["all"]
    rows = RowContexts([*prompt, *generated], len(prompt), draft, parents)
    warped = target_logits(logits, params, rows)
    for r in range(len(draft) + 1):
        expected = naive_warp(logits[r], params, prompt, generated + rows.row_tokens(r))
        torch.testing.assert_close(warped[r], expected, rtol=0, atol=1e-5)
    assert rows.row_tokens(len(draft)) == ([6, 6] if parents is not None else [5, 7, 7, 1])


def test_no_warp_returns_the_logits_themselves():
    logits = torch.randn(3, 8)
    rows = RowContexts([1, 2], 1, torch.tensor([3, 4]))
    assert target_logits(logits, sd.SamplingParams(temperature=1.0, min_p=0.5), rows) is logits


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 2.0 + torch.log(torch.tensor(0.2)).item() - 1e-4]])
    kept = sd.sampling.warp_logits(logits, 1.0, min_p=0.2).isfinite()[0].tolist()
    probs = torch.softmax(logits.double(), -1)[0]
    assert kept == (probs >= 0.2 * probs.max()).tolist() == [True, True, False, False, False]


# ------------------------------------------------------------------------------------------------ greedy, seeds

GREEDY_WARPS = {
    "presence": sd.SamplingParams(presence_penalty=1.5, max_new_tokens=40),
    "frequency": sd.SamplingParams(frequency_penalty=0.8, max_new_tokens=40),
    "repetition": sd.SamplingParams(repetition_penalty=1.6, max_new_tokens=40),
    "logit_bias": sd.SamplingParams(logit_bias={3: 4.0, 17: -100.0, 42: 2.0}, max_new_tokens=40),
    "min_p": sd.SamplingParams(min_p=0.3, max_new_tokens=40),
}
PROMPT = [3, 17, 42, 5, 3, 17, 42]


def greedy_proposers(target: sd.LoadedModel, draft: sd.LoadedModel) -> dict[str, sd.Proposer]:
    return {
        "draft": sd.DraftModelProposer(draft),
        "lookup": sd.PromptLookupProposer(max_ngram=2),
        "lookup-tree": sd.PromptLookupProposer(max_ngram=2, branches=3),
    }


@pytest.mark.parametrize("warp", list(GREEDY_WARPS))
def test_greedy_speculation_equals_plain_decoding_with_each_warp(large_target, large_draft, warp):
    """Token for token, chain and tree, gamma 1 and 4; the warp changes plain decoding's output (it is not a no-op
    on this prompt) except min-p, which greedy ignores."""
    params = GREEDY_WARPS[warp]
    plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
    unwarped = sd.autoregressive_generate(large_target, PROMPT, sd.SamplingParams(max_new_tokens=40)).token_ids
    assert (plain == unwarped) == (warp == "min_p")
    for name, proposer in greedy_proposers(large_target, large_draft).items():
        for gamma in (1, 4):
            out = sd.SpeculativeDecoder(large_target, proposer, gamma=gamma).generate(PROMPT, params)
            assert out.token_ids == plain, (warp, name, gamma)


def test_greedy_identity_fails_with_the_counts_one_row_late(large_target, large_draft, monkeypatch):
    """The control reaches the production path: with each row's own draft token left out of its counts, speculative
    greedy output departs from plain decoding for some penalty."""
    monkeypatch.setattr(specdecode.sampling.warps.RowContexts, "paths", one_row_late)
    differs = []
    for warp in ("presence", "frequency", "repetition"):
        params = GREEDY_WARPS[warp]
        plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
        for proposer in greedy_proposers(large_target, large_draft).values():
            differs.append(sd.SpeculativeDecoder(large_target, proposer, gamma=4).generate(PROMPT, params).token_ids)
            differs[-1] = differs[-1] != plain
    assert any(differs)


@pytest.mark.parametrize("warp", ["presence", "frequency", "repetition", "logit_bias", "min_p"])
def test_reproducible_mode_equals_plain_sampling_with_each_warp(large_target, large_draft, warp):
    """Same seed, same tokens: reproducible speculation at T 0.8 with each warp, chain and tree."""
    base = GREEDY_WARPS[warp]
    for seed in (0, 7):
        params = sd.SamplingParams(**{**base.__dict__, "temperature": 0.8, "seed": seed})
        plain = sd.autoregressive_generate(large_target, PROMPT, params).token_ids
        for name, proposer in greedy_proposers(large_target, large_draft).items():
            decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=4, mode="reproducible")
            assert decoder.generate(PROMPT, params).token_ids == plain, (warp, name, seed)


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in \\[-2, 2\\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in \\[-2, 2\\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a number > 0"),
        ({"min_p": 1.5}, "min_p must be in \\[0, 1\\]"),
        ({"logit_bias": {3: 101}}, "logit_bias values must be numbers in \\[-100, 100\\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias keys must be token ids"),
    ],
)
def test_bad_warp_settings_are_refused_with_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        sd.SamplingParams(**fields)


def test_logit_bias_past_the_vocabulary_is_refused(large_target):
    with pytest.raises(ValueError, match="logit_bias names token 64, past the vocabulary"):
        sd.autoregressive_generate(large_target, PROMPT, sd.SamplingParams(logit_bias={64: 1.0}))
    assert sd.SamplingParams(logit_bias={9: 1, 2: -3.5}).logit_bias == ((2, -3.5), (9, 1.0))
