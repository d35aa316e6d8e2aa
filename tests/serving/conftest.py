"""The serving tests' shared server: the tiny word target behind a real uvicorn server on a free loopback port
(speculating always, gamma 4, model id "tiny"), with the failing, slow and feature-checking proposers the tests
name per request; and ``http``, a client of whichever ``server`` a test module uses (a module may define its own)."""

from __future__ import annotations

import time

import httpx
import pytest
from helpers.models import word_target
from helpers.serving import serve
from helpers.tokenizers import CHAT_TEMPLATE

import specdecode as sd
from specdecode.sampling.draft import EMPTY_DRAFT


class Boom:
    """Raises on its first proposal."""

    def propose(self, context, k, params, generator):
        raise RuntimeError("boom")


class LateBoom:
    """Drafts nothing for two rounds, then raises: the failure comes mid-stream."""

    def __init__(self):
        self.calls = 0

    def propose(self, context, k, params, generator):
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("late boom")
        return EMPTY_DRAFT


class FeatureCheck:
    """Needs the target's features (as an EAGLE head): checks it is given one row per verified position."""

    needs_target_hidden = True

    def __init__(self):
        self.rows = 0

    def observe_target(self, hidden):
        self.rows = sum(int(h.shape[0]) for h in hidden)

    def propose(self, context, k, params, generator):
        if self.rows != len(context) - 1:
            raise AssertionError(f"{self.rows} feature rows for a context of {len(context)} tokens")
        return sd.PromptLookupProposer().propose(context, k, params, generator)


class Slow:
    """Drafts nothing, slowly: keeps a request running long enough to disconnect from it."""

    def propose(self, context, k, params, generator):
        time.sleep(0.02)
        return EMPTY_DRAFT


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return word_target(chat_template=CHAT_TEMPLATE, backend="native")


@pytest.fixture(scope="module")
def server(target):
    proposers = {
        "boom": Boom,
        "late-boom": LateBoom,
        "slow": Slow,
        "tree": lambda: sd.PromptLookupProposer(branches=3),
        "features": FeatureCheck,
    }
    with serve(target, max_body_bytes=100_000, proposers=proposers) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
