"""The ``Proposer`` base class: shipped proposers subclass it, the engine and the server call its hooks directly,
and a user's object with only ``propose`` (duck-typed, as documented) is adapted where it enters and still runs."""

from __future__ import annotations

import httpx
import pytest
from helpers.models import word_target

import specdecode as sd
import specdecode.proposers as proposers
from specdecode.proposers.base import DuckTypedProposer, Proposer, as_proposer
from specdecode.serving import ServerConfig, create_app
from specdecode.serving.local import LocalServer

PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"
GREEDY = sd.SamplingParams(temperature=0.0, max_new_tokens=16)


class OnlyPropose:
    """A user's proposer: a plain class with ``propose`` and nothing else (it copies as prompt lookup does)."""

    def __init__(self) -> None:
        self.calls = 0
        self._lookup = sd.PromptLookupProposer()

    def propose(self, context, k, params, generator):
        self.calls += 1
        return self._lookup.propose(context, k, params, generator)


class Remembers(OnlyPropose):
    """Duck-typed with one hook of its own: ``end_request``."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: list[int] = []

    def end_request(self, context):
        self.ended.append(len(context))


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return word_target(backend="native")


def test_every_shipped_proposer_subclasses_the_base_class():
    shipped = [getattr(proposers, name) for name in proposers.__all__ if name.endswith("Proposer")]
    assert len(shipped) >= 7 and all(issubclass(cls, Proposer) for cls in shipped if cls is not Proposer)
    assert not issubclass(OnlyPropose, Proposer)  # the control: a duck is not one


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_a_duck_typed_proposer_runs_through_the_decoder_greedy_identical(target, gamma):
    duck = OnlyPropose()
    decoder = sd.SpeculativeDecoder(target, proposer=duck, gamma=gamma)
    assert isinstance(decoder.proposer, DuckTypedProposer) and decoder.proposer.wrapped is duck
    out = decoder.generate(PROMPT, GREEDY)
    assert out.token_ids == sd.autoregressive_generate(target, PROMPT, GREEDY).token_ids
    assert duck.calls > 0 and (gamma == "auto" or out.stats.drafted > 0)


def test_a_duck_typed_proposers_own_hooks_are_called_and_the_rest_are_no_ops(target):
    duck = Remembers()
    decoder = sd.SpeculativeDecoder(target, proposer=duck, gamma=4)
    decoder.generate(PROMPT, GREEDY)
    decoder.generate(PROMPT, GREEDY)
    assert len(duck.ended) == 2  # end_request forwarded, once a request
    adapted = as_proposer(OnlyPropose())
    adapted.bind_target("vocabulary", None, 10)  # the base class's no-ops
    adapted.end_request([1, 2])
    assert not adapted.needs_target_hidden and adapted.vocabulary_model() is None
    with pytest.raises(TypeError, match="keyed noise"):
        adapted.propose_coupled([1], 1, GREEDY, None)  # type: ignore[arg-type]


def test_an_object_without_propose_is_refused_in_one_line(target):
    for bad in (object(), "lookup"):
        with pytest.raises(ValueError, match=r"propose\(context, k, params, generator\)"):
            sd.SpeculativeDecoder(target, proposer=bad)


def test_a_duck_typed_proposer_runs_through_the_server(target):
    config = ServerConfig(target=target, gamma=4, policy="always", proposers={"duck": OnlyPropose})
    with LocalServer(create_app(config)) as running:
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "speculative": {"proposer": "duck"}}
        answer = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
    expected = sd.autoregressive_generate(target, target.encode(PROMPT), GREEDY).text
    assert answer["choices"][0]["text"] == expected
    assert answer["usage"]["accepted_tokens"] > 0  # it drafted, and was right
