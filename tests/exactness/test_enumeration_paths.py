"""Exact laws for the paths the enumerated tests did not reach (issue 53): ``gamma="auto"`` in exact mode, top-k with
top-p, T = 1.5, and an EOS token or a stop string inside an accepted run — each computed exactly (every random decision
enumerated through the real engine) and compared with the target's own law in total variation, bound 1e-6 (float32
target probabilities leave ~1e-8: tests/exactness/test_enumeration.py), each with a control that must miss by ≥ 100× the
bound.

``enumeration.engine_law`` applies to the warps. It reads a run's outcome from the decisions and stops as soon as the
tokens asked about are decided, and it refuses ``gamma="auto"`` (which times passes); ``output_law`` here runs every
request to its end and takes the engine's own output (token ids and text), so that what is tested is the engine's cut
at an EOS or a stop string, bonus dropped — and it runs ``gamma="auto"`` with a fixed cost model
(``PassCosts.line``, as tests/engine/test_gamma_auto.py injects costs) and a fresh acceptance memory per run (each run
is the decoder's first request), so each round's length is a function of the earlier decisions only. The Enumerator
checks that itself: a decision met with another branch count than in an earlier run raises. These laws run through the
torch verification path (the plain Enumerator is not a ``choices.UniformsChoices``); the same engine through the
compiled ops (``engine_law(through_kernels=True)``) is in tests/exactness/test_enumeration_kernels.py, the ops' own laws
in tests/kernels/test_kernel_laws.py.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from helpers.enumeration import BOUND, LOOKUP_PROMPT, MIXED, guided_tables
from helpers.kernels import use_build
from helpers.models import SMALL_VOCAB, tiny_llama, with_eos
from helpers.tokenizers import fixed_width_words, word_tokenizer
from helpers.trees import TreeProposer

import specdecode as sd
import specdecode.engine.decoder
import specdecode.engine.output
import specdecode.sampling.verify
from specdecode.control import AcceptanceHistory, PassCosts
from specdecode.exactness.enumeration import Enumerator, KernelEnumerator, engine_law, prefix_law, total_variation

WARPS = {
    "T1.5": sd.SamplingParams(temperature=1.5, max_new_tokens=4),
    "T0.9-topk4-topp0.8": sd.SamplingParams(temperature=0.9, top_k=4, top_p=0.8, max_new_tokens=4),
}
# Whole requests (output_law): top-k 4 keeps the branches per draw at 4; T 1.5 spreads the law over them
WHOLE = sd.SamplingParams(temperature=1.5, top_k=4, max_new_tokens=4)


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return sd.load_model(tiny_llama(SMALL_VOCAB, seed=0), tokenizer=word_tokenizer(fixed_width_words(SMALL_VOCAB)))


def output_law(
    decoder: sd.SpeculativeDecoder,
    prompt: list[int],
    params: sd.SamplingParams,
    max_runs: int = 20_000,
    through_kernels: bool = False,
):
    """The law of a whole request's output, (token ids, text) → probability, every decision enumerated depth-first
    as ``engine_law`` does (``through_kernels``: through the compiled ops, ``KernelEnumerator``); each run starts from
    a fresh acceptance memory. Returns (law, runs, lengths drafted)."""
    law: dict[tuple, float] = defaultdict(float)
    memo: dict = {}
    scripts: list[list[tuple[int, int]]] = [[]]
    runs, drafted = 0, set()
    proposer_propose = decoder.proposer.propose

    def propose(context, k, params, generator):
        drafted.add(k)
        return proposer_propose(context, k, params, generator)

    decoder.proposer.propose = propose
    try:
        while scripts:
            runs += 1
            assert runs <= max_runs, "too many decisions to enumerate"
            script = scripts.pop()
            if through_kernels:
                choices = KernelEnumerator(script, 1 << 30, (), memo)
            else:
                choices = Enumerator(script, wanted=1 << 30, eos=())
            decoder.acceptance_memories = {"": AcceptanceHistory()}
            request = decoder._start(prompt, params, None, None)
            request.generator = choices
            while not request.done:
                decoder._round(request)
            out = request.finish()
            law[(tuple(out.token_ids), out.text)] += choices.weight
            for position in range(len(script), len(choices.taken)):
                count = choices.taken[position][1]
                scripts.extend([*choices.taken[:position], (branch, count)] for branch in range(1, count))
    finally:
        del decoder.proposer.propose
    return dict(law), runs, drafted


def plain_output_law(target: sd.LoadedModel, prompt: list[int], params: sd.SamplingParams) -> dict[tuple, float]:
    """Plain decoding's law of (token ids, text): the target's law of max_new_tokens tokens (``prefix_law``, ending at
    an EOS), each sequence cut after the token that completes a stop string, the text ending before it — written out
    here, not through the engine's OutputSink, so that a sink bug cannot hide in the reference."""
    law: dict[tuple, float] = defaultdict(float)
    for tokens, mass in prefix_law(target, prompt, params, tokens=params.max_new_tokens).items():
        text = target.decode(list(tokens))
        for end in range(1, len(tokens) + 1):
            hits = [i for s in params.stop if (i := target.decode(list(tokens[:end])).find(s)) >= 0]
            if hits:
                tokens, text = tokens[:end], target.decode(list(tokens[:end]))[: min(hits)]
                break
        law[(tuple(tokens), text)] += mass
    return dict(law)


def residual_mixed(monkeypatch) -> None:
    """The control of tests/exactness/test_enumeration.py: every residual after a rejection mixed 1% with the target's
    law."""
    correct = specdecode.sampling.verify._residual

    def mixed(target_probs, draft, token):
        residual = correct(target_probs, draft, token)
        return (1 - MIXED) * residual / residual.sum() + MIXED * target_probs / target_probs.sum()

    monkeypatch.setattr(specdecode.sampling.verify, "_residual", mixed)


# ------------------------------------------------------------------------------------------------ gamma="auto"


def auto_decoder(target: sd.LoadedModel) -> sd.SpeculativeDecoder:
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma="auto", max_gamma=4)
    decoder.costs = PassCosts.line(1.0, 0.05, {"": 0.1})  # v(k) = 1 + 0.05 (k − 1), c = 0.1: no clock
    return decoder


@pytest.mark.parametrize("control", ["none", "through-kernels", "residual-mixed-1%", "through-kernels-mutant-index"])
def test_gamma_auto_in_exact_mode_gives_the_targets_law(target, control, monkeypatch):
    """Proves the adaptive draft length keeps the law exact: a whole 4-token request (T 1.5, top-k 4) under
    gamma="auto" with fixed costs — lengths chosen from the acceptance seen so far, several lengths drafted — has
    the target's law to 1e-6, on the torch verification path and through the compiled ops. Controls: every residual
    mixed 1% with p (torch path); the index-shifting kernels build (compiled path) — each must miss by ≥ 100× the
    bound."""
    through_kernels = control.startswith("through-kernels")
    if through_kernels:
        use_build("mutant_index" if control.endswith("index") else "native", monkeypatch)
    if control == "residual-mixed-1%":
        residual_mixed(monkeypatch)
    law, runs, drafted = output_law(auto_decoder(target), LOOKUP_PROMPT, WHOLE, through_kernels=through_kernels)
    tv = total_variation(law, plain_output_law(target, LOOKUP_PROMPT, WHOLE))
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12) and runs > 100
    if control in ("none", "through-kernels"):
        assert len(drafted - {0}) >= 2, drafted  # the controller chose lengths, not one fixed gamma
        assert tv < BOUND, (tv, runs)
    else:
        assert tv > 100 * BOUND, tv


# ------------------------------------------------------------------------------------------------ warps


def warp_case(name: str, target: sd.LoadedModel) -> tuple[sd.SpeculativeDecoder, list[int]]:
    if name == "chain/lookup":
        return sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=2), LOOKUP_PROMPT
    proposer = TreeProposer((3, 2), guided_tables(target, 2, 1), sampled=False)
    return sd.SpeculativeDecoder(target, proposer, gamma=2), [1, 2, 3]


def top_p_before_top_k(logits, params):
    """WRONG (a control): the nucleus taken before top-k, on the full distribution."""
    scaled = sd.sampling.warp_logits(logits, params.temperature, 0, params.top_p)
    return torch.softmax(sd.sampling.warp_logits(scaled, 1.0, params.top_k, 1.0), dim=-1)


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("control", ["none", "residual-mixed-1%", "top-p-before-top-k"])
@pytest.mark.parametrize("warp", list(WARPS))
@pytest.mark.parametrize("name", ["chain/lookup", "tree/deep-wide-3-2"])
def test_warped_laws_are_the_targets_exactly(target, name, warp, control, path, monkeypatch):
    """Proves top-k with top-p (applied in that order) and T > 1 keep the engine's law of the first two tokens the
    target's to 1e-6, chain and tree, on the torch verification path and through the compiled ops a float32 CPU
    request runs (``through_kernels``). Controls: a residual mixed 1% with p (through the kernels the chain's
    residual is compiled code: there the build whose point-mass residual keeps the guess, kernels.MUTANTS; the
    tree's residual is torch code on both paths); the warps applied in the wrong order in the engine (top-p first)
    — each must miss by ≥ 100× the bound."""
    params = WARPS[warp]
    if control == "top-p-before-top-k" and not params.top_k:
        pytest.skip("one warp: no order to get wrong")
    through_kernels = path == "kernels"
    compiled_residual = through_kernels and name.startswith("chain") and control == "residual-mixed-1%"
    if through_kernels:
        use_build("mutant_point_mass" if compiled_residual else "native", monkeypatch)
    if control == "residual-mixed-1%" and not compiled_residual:
        residual_mixed(monkeypatch)
    if control == "top-p-before-top-k":
        monkeypatch.setattr(specdecode.engine.decoder, "probs_from_logits", top_p_before_top_k)
    decoder, prompt = warp_case(name, target)
    result = engine_law(decoder, prompt, params, tokens=2, through_kernels=through_kernels)
    tv = total_variation(result.law, prefix_law(target, prompt, params, tokens=2))
    assert result.runs > 1 and result.accepted_mass > 0.05, result
    if control == "none":
        assert tv < BOUND, (name, warp, tv, result.runs)
    else:
        assert tv > 100 * BOUND, (name, warp, control, tv)


# ------------------------------------------------------------------------------------------------ EOS, stop strings


def keeps_the_round(self, tokens):
    """WRONG (a control): a round's tokens kept whole, the stop condition checked after them (the bonus and the
    guesses after an EOS or a stop string emitted)."""
    tokens = list(tokens)
    room = self._max_new_tokens - len(self.token_ids)
    self.token_ids.extend(int(t) for t in tokens[:room])
    if self._eos.intersection(self.token_ids):
        self.finish_reason = "eos"
    elif self._stop and self._completes_stop():
        self.finish_reason = "stop"
    elif len(self.token_ids) >= self._max_new_tokens:
        self.finish_reason = "length"
    return min(len(tokens), room)


ENDS = {  # after LOOKUP_PROMPT "7 4 1 7 4 1 7 4" prompt lookup guesses "1 7 4": both ends fall inside that run
    "eos-7": ({7}, ()),
    "stop-'w01 w07'": (set(), ("w01 w07",)),  # spans two tokens
}


@pytest.mark.parametrize("path", ["torch", "kernels"])
@pytest.mark.parametrize("control", [False, True], ids=["exact", "round-kept-whole-control"])
@pytest.mark.parametrize("end", list(ENDS))
def test_an_eos_or_stop_string_inside_an_accepted_run_ends_the_output_exactly(target, end, control, path, monkeypatch):
    """Proves the engine's output (token ids and text of whole 4-token requests, T 1.5, top-k 4, prompt lookup at
    gamma 3) has plain decoding's law to 1e-6 when an EOS token or a stop string spanning two tokens falls inside an
    accepted run (mass ≥ 5% does): the run is cut there, the bonus dropped, the text ends before the stop string.
    Control: a sink that keeps a round's tokens whole and checks the end after them must miss by ≥ 100× the bound.
    On the torch verification path and through the compiled ops (the sink is after either)."""
    if path == "kernels":
        use_build("native", monkeypatch)
    eos, stop = ENDS[end]
    loaded = with_eos(target, *eos)
    params = sd.SamplingParams(temperature=1.5, top_k=4, max_new_tokens=4, stop=stop)
    if control:
        monkeypatch.setattr(specdecode.engine.output.OutputSink, "push", keeps_the_round)
    decoder = sd.SpeculativeDecoder(loaded, sd.PromptLookupProposer(), gamma=3)
    law, runs, _ = output_law(decoder, LOOKUP_PROMPT, params, through_kernels=path == "kernels")
    reference = plain_output_law(loaded, LOOKUP_PROMPT, params)
    ended_inside = sum(m for (tokens, _), m in reference.items() if tokens[:2] == (1, 7))  # "1 7": guesses 1 and 2
    assert ended_inside > 0.05, ended_inside
    tv = total_variation(law, reference)
    if control:
        assert tv > 100 * BOUND, tv
    else:
        assert tv < BOUND, (end, tv, runs)
