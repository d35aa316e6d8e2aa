"""The server's sampling promises under concurrency (issue 53): 16 requests at once, four proposers mixed in each
batched pass (prompt lookup chains, prompt-lookup trees, a layer-skip self-draft with sampled guesses, plain).

Exact mode. The scheduler verifies each request with the engine's own code (``SpeculativeDecoder.draft`` and
``settle``, the request's seeded generator, ``policy="always"`` drafting the full gamma as ``generate`` does) on logits
that row invariance makes bitwise the request's own; so a seeded request's output is the engine's output for that
seed, whatever shares its batch — tested here token for token, for every request. The engine's law is computed
exactly elsewhere, through the same compiled ops (tests/exactness/test_enumeration_kernels.py,
tests/proposers/test_layer_skip.py, tests/exactness/test_enumeration.py: TV < 1e-6, each with a control), so the
server's law is the target's with that bound, not a sampled test's. Control: a server whose exact-mode verification
resamples every rejection from p must give other outputs for some request.

Reproducible mode. Sampled text and logprobs (the chosen token's and the top alternatives', floats compared exactly)
are plain decoding's for each request's seed, in the same mixed batches — under ``policy="always"`` and under the
server's default ``policy="auto"`` (which chooses each request's draft length, 0 included, from the measured
acceptance and pass costs: identity must hold whatever it chooses).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers.models import LARGE_VOCAB, word_target

import specdecode as sd
import specdecode.sampling.verify
from specdecode.sampling.draft import EMPTY_DRAFT
from specdecode.serving import ServerConfig, create_app
from specdecode.serving.local import LocalServer

GAMMA = 3
PROMPTS = [" ".join(f"w{(3 * i + j * j) % LARGE_VOCAB}" for j in range(3 + i % 4)) * 2 for i in range(16)]
FACTORIES = {
    "lookup": sd.PromptLookupProposer,
    "tree": lambda: sd.PromptLookupProposer(branches=3),
    "skip": None,  # filled per target: sd.LayerSkipProposer(target, num_layers=1)
    "none": None,  # plain decoding
}
NAMES = list(FACTORIES)


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return word_target(backend="native")


def factories(target) -> dict:
    return {"tree": FACTORIES["tree"], "skip": lambda: sd.LayerSkipProposer(target, num_layers=1)}


def params_of(i: int) -> sd.SamplingParams:
    return sd.SamplingParams(temperature=1.0, top_k=8 if i % 2 else 0, max_new_tokens=12, seed=100 + i)


def body_of(i: int, **extra) -> dict:
    p = params_of(i)
    name = NAMES[i % len(NAMES)]
    speculative = False if name == "none" else {"proposer": name, "gamma": GAMMA}
    return {"prompt": PROMPTS[i], "max_tokens": p.max_new_tokens, "temperature": p.temperature, "top_k": p.top_k,
            "seed": p.seed, "speculative": speculative, **extra}  # fmt: skip


def serve_all(target, mode: str, monkeypatch, policy: str = "always", **extra) -> tuple[list[dict], list[list[int]]]:
    """The 16 requests sent at once to a fresh server in ``mode`` under ``policy``; their JSON answers and the row
    counts of every batched target pass (per request in the pass)."""
    passes: list[list[int]] = []
    runner_class = type(target.new_runner())
    real = runner_class.forward_batch

    def spy(self, runners, tokens):
        passes.append([int(t.shape[0]) for t in tokens])
        return real(self, runners, tokens)

    monkeypatch.setattr(runner_class, "forward_batch", spy)
    config = ServerConfig(target=target, gamma=GAMMA, policy=policy, mode=mode, proposers=factories(target))
    with LocalServer(create_app(config)) as running, httpx.Client(base_url=running.url, timeout=120) as http:

        def ask(i: int) -> dict:
            response = http.post("/v1/completions", json=body_of(i, **extra))
            assert response.status_code == 200, response.text
            return response.json()

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, range(16)))
    return answers, passes


def assert_batched(passes: list[list[int]]) -> None:
    """Batches formed: passes of several requests, some of them verifying drafts beside plain rows."""
    assert max(len(p) for p in passes) >= 4, max(len(p) for p in passes)
    assert any(len(p) > 1 and max(p) > 1 and min(p) == 1 for p in passes), "no pass mixed drafts and plain steps"


def engine_output(target, i: int, mode: str, logprobs: int | None = None) -> sd.GenerationOutput:
    """What the library gives request i alone: the engine with its proposer (exact mode; none: the engine's plain
    rounds, which draw from the request's generator where plain decoding uses keyed noise), or plain decoding."""
    ids = target.encode(PROMPTS[i])
    name = NAMES[i % len(NAMES)]
    if mode == "reproducible":
        return sd.autoregressive_generate(target, ids, params_of(i), logprobs=logprobs)
    proposer = NoDraft() if name == "none" else factories(target).get(name, FACTORIES[name])()
    return sd.SpeculativeDecoder(target, proposer, gamma=GAMMA, mode=mode).generate(ids, params_of(i))


class NoDraft:
    """Drafts nothing: the engine's plain rounds (a decoder without a proposer drafts with prompt lookup)."""

    def propose(self, context, k, params, generator):
        return EMPTY_DRAFT


def resample_from_p(target_probs, draft_probs, draft_tokens, generator):
    """WRONG (the control): the chain rule with every rejection resampled from p instead of the residual."""
    n, _ = specdecode.sampling.verify.speculative_sample(target_probs, draft_probs, draft_tokens, generator)
    if n == len(draft_tokens):
        return n, _
    return n, int(sd.sampling.sample(target_probs[n], generator))


@pytest.mark.parametrize("control", [False, True], ids=["exact", "resample-from-p-control"])
def test_exact_mode_under_concurrency_gives_each_request_the_engines_output(target, control, monkeypatch):
    """Proves the served exact mode is the engine's, request by request, in batches of mixed proposers: every
    seeded output equals ``SpeculativeDecoder.generate``'s for that seed (so the server inherits the engine's exact
    laws). Control: the server verifying with a rule that resamples rejections from p differs somewhere."""
    expected = [engine_output(target, i, "exact").text for i in range(16)]
    if control:
        monkeypatch.setattr(sd.engine.decoder, "speculative_sample", resample_from_p)
    answers, passes = serve_all(target, "exact", monkeypatch)
    got = [a["choices"][0]["text"] for a in answers]
    assert_batched(passes)
    drafted = [a["usage"]["drafted_tokens"] for a in answers]
    assert all(d > 0 for d, i in zip(drafted, range(16), strict=True) if NAMES[i % 4] != "none"), drafted
    if control:
        assert got != expected
    else:
        assert got == expected
        accepted = sum(a["usage"]["accepted_tokens"] for a in answers)
        assert 0 < accepted < sum(drafted)  # both verification outcomes happened


def accept_every_guess(target_tokens, draft_tokens):
    """WRONG (the control): reproducible mode's coupled rule keeping every guess."""
    return len(draft_tokens), int(target_tokens[len(draft_tokens)])


@pytest.mark.parametrize("policy", ["always", "auto"])
@pytest.mark.parametrize("control", [False, True], ids=["reproducible", "accept-every-guess-control"])
def test_reproducible_mode_under_concurrency_gives_plain_sampling_text_and_logprobs(
    target, control, policy, monkeypatch
):
    """Proves the served reproducible mode: in batches of mixed proposers, each request's sampled text, token
    logprobs and top-2 alternatives are plain decoding's for its seed, bitwise — with every guess drafted and under
    the default policy. Control: a coupled rule that keeps every guess gives another text for some request."""
    if control:
        monkeypatch.setattr(sd.engine.decoder, "coupled_verify", accept_every_guess)
    answers, passes = serve_all(target, "reproducible", monkeypatch, policy=policy, logprobs=2)
    if not (control and policy == "auto"):  # keeping every guess, "auto" measures acceptance 1 and drafts for all
        assert_batched(passes)
    assert sum(a["usage"]["drafted_tokens"] for a in answers) > 0, "the policy never speculated"
    plain = [engine_output(target, i, "reproducible", logprobs=2) for i in range(16)]
    if control:
        assert [a["choices"][0]["text"] for a in answers] != [p.text for p in plain]
        return
    for i, (answer, expected) in enumerate(zip(answers, plain, strict=True)):
        choice = answer["choices"][0]
        assert choice["text"] == expected.text, i
        assert choice["logprobs"]["token_logprobs"] == [lp.logprob for lp in expected.logprobs], i
        served = [[(text.strip(), v) for text, v in top.items()] for top in choice["logprobs"]["top_logprobs"]]
        assert served == [[(target.decode([t]), v) for t, v in lp.top] for lp in expected.logprobs], i
