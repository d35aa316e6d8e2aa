"""The server's prefix cache inside the scheduler: requests reuse the KV rows of earlier and running requests.

Texts and logprobs after a hit equal plain decoding's bitwise (so cache on and off give the same text), with
speculative rounds that roll back; concurrent requests share a system prompt; a request cancelled while its
blocks serve others changes nothing; eviction keeps the budget. Over HTTP: ``usage.prompt_tokens_details``
and the /metrics counters.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from helpers.models import LARGE_VOCAB, quantizable_llama

import specdecode as sd
from specdecode.engine.request import Request
from specdecode.serving import ServerConfig, create_app
from specdecode.serving.batching.policy import SpeculationPolicy
from specdecode.serving.batching.prefix_cache import PrefixCache
from specdecode.serving.batching.scheduler import Job, Scheduler, Speculation
from specdecode.serving.local import LocalServer

SYSTEM = [(7 * i + 3) % LARGE_VOCAB for i in range(70)]  # a 70-token "system prompt": two 32-token blocks
GREEDY = sd.SamplingParams(max_new_tokens=20)
LOOKUP = Speculation("lookup", 4)


class Features:
    """Reads the target's features as an EAGLE head does (and records them), drafting by prompt lookup."""

    needs_target_hidden = True
    seen: list[torch.Tensor] = []

    def observe_target(self, hidden):
        Features.seen = hidden

    def propose(self, context, k, params, generator):
        return sd.PromptLookupProposer().propose(context, k, params, generator)


class Slow:
    """Drafts by lookup, slowly: keeps a request running while others come and go."""

    def propose(self, context, k, params, generator):
        time.sleep(0.02)
        return sd.PromptLookupProposer().propose(context, k, params, generator)


@pytest.fixture(scope="module", params=[("float32", None), ("float32", "int4")], ids=["torch", "kernels-int4"])
def target(request):
    dtype, quantization = request.param
    return sd.load_model(quantizable_llama(LARGE_VOCAB, seed=11), dtype=dtype, quantization=quantization)


def _scheduler(target, cache: PrefixCache | None, max_batch: int = 4) -> Scheduler:
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=4, mode="reproducible")
    proposers = {"lookup": sd.PromptLookupProposer, "features": Features, "slow": Slow}
    scheduler = Scheduler(decoder, proposers, SpeculationPolicy("always"), max_batch, prefix_cache=cache)
    scheduler.start()
    return scheduler


class Waiter:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.output = None
        self.error = ""

    def __call__(self, event) -> None:
        if event.kind == "done":
            self.output = event.output
        if event.kind == "error":
            self.error = event.error
        if event.kind in ("done", "error"):
            self.done.set()


def _submit(scheduler, target, prompt, speculation=LOOKUP, params=GREEDY, logprobs=None) -> tuple[Job, Waiter]:
    waiter = Waiter()
    job = Job(Request(target, prompt, params, None, logprobs), speculation, waiter)
    scheduler.submit(job)
    return job, waiter


def _run(scheduler, target, prompt, **kw):
    _, waiter = _submit(scheduler, target, prompt, **kw)
    assert waiter.done.wait(120) and not waiter.error, waiter.error
    return waiter.output


def _plain(target, prompt, logprobs=None):
    return sd.autoregressive_generate(target, prompt, GREEDY, logprobs=logprobs)


def test_a_hit_after_a_finished_request_is_bitwise_plain_decoding(target):
    scheduler = _scheduler(target, PrefixCache(1 << 30))
    try:
        first = _run(scheduler, target, SYSTEM + [1, 2])
        assert first.cached_tokens == 0
        turn = SYSTEM + [1, 2] + first.token_ids + [5, 6, 7]  # a chat's next turn: 95 tokens
        out = _run(scheduler, target, turn, logprobs=3)
        assert out.cached_tokens == 64  # two whole blocks; tokens 64..93 prefilled (the hit ends mid-history)
        plain = _plain(target, turn, logprobs=3)
        assert out.token_ids == plain.token_ids and out.logprobs == plain.logprobs  # floats: bitwise
        assert out.stats.drafted > out.stats.accepted  # speculative rounds rolled back after the hit
        cache = scheduler.prefix_cache
        assert cache.hit_tokens == 64 and cache.queried_tokens == 71 + 94
        assert scheduler.metrics.prefix_cache_hits._value.get() == 64
        assert scheduler.metrics.prefix_cache_bytes._value.get() == cache.bytes > 0
    finally:
        scheduler.stop()


def test_cache_on_or_off_gives_the_same_text_and_concurrent_requests_share_a_system_prompt(target):
    prompts = [SYSTEM + [i, i + 1, 2 * i] for i in range(6)]
    texts = {}
    for cache in (None, PrefixCache(1 << 30)):
        scheduler = _scheduler(target, cache)
        try:
            jobs = [_submit(scheduler, target, p) for p in prompts]  # arrive together; four run at once
            for _, waiter in jobs:
                assert waiter.done.wait(120) and not waiter.error
            texts[cache is None] = [w.output.token_ids for _, w in jobs]
            hits = [w.output.cached_tokens for _, w in jobs]
        finally:
            scheduler.stop()
        assert hits == ([0] * 6 if cache is None else [0] + [64] * 5)  # the first one's prompt served the rest
    assert texts[True] == texts[False] == [_plain(target, p).token_ids for p in prompts]


def test_a_request_cancelled_while_its_blocks_are_shared_changes_nothing(target):
    scheduler = _scheduler(target, PrefixCache(1 << 30))
    try:
        long, slow = sd.SamplingParams(max_new_tokens=200), Speculation("slow", 4)
        victim, victim_waiter = _submit(scheduler, target, SYSTEM + [9], speculation=slow, params=long)
        time.sleep(0.3)  # admitted: its prompt's blocks are cached
        _, sharer_waiter = _submit(scheduler, target, SYSTEM + [8], speculation=slow)
        time.sleep(0.1)
        scheduler.cancel(victim)
        assert sharer_waiter.done.wait(120) and not sharer_waiter.error
        assert sharer_waiter.output.cached_tokens == 64
        assert sharer_waiter.output.token_ids == _plain(target, SYSTEM + [8]).token_ids
        later = _run(scheduler, target, SYSTEM + [7])
        assert later.cached_tokens == 64 and later.token_ids == _plain(target, SYSTEM + [7]).token_ids
        assert victim_waiter.output is None
    finally:
        scheduler.stop()


def test_eviction_keeps_the_budget_and_the_text(target):
    probe = PrefixCache(1 << 30)
    scheduler = _scheduler(target, probe)
    try:
        _run(scheduler, target, SYSTEM + [1])
    finally:
        scheduler.stop()
    block_bytes = probe.bytes // len(probe)
    cache = PrefixCache(3 * block_bytes)
    scheduler = _scheduler(target, cache)
    try:
        others = [[(5 * i + j) % LARGE_VOCAB for i in range(70)] for j in range(3)]
        for prompt in [SYSTEM + [1], *(o + [1] for o in others), SYSTEM + [2]]:
            out = _run(scheduler, target, prompt)
            assert out.token_ids == _plain(target, prompt).token_ids
            assert cache.bytes <= 3 * block_bytes
        assert cache.evicted_blocks > 0 and out.cached_tokens == 0  # SYSTEM's blocks were evicted
    finally:
        scheduler.stop()


def test_a_request_that_reads_the_targets_features_reuses_blocks_that_carry_them(target):
    scheduler = _scheduler(target, PrefixCache(1 << 30))
    features = Speculation("features", 4)
    try:
        plain = _run(scheduler, target, SYSTEM + [1])  # blocks without features
        first = _run(scheduler, target, SYSTEM + [2], speculation=features)
        assert plain.cached_tokens == 0 and first.cached_tokens == 0  # a miss: no features to reuse ...
        full = torch.cat(Features.seen)
        second = _run(scheduler, target, SYSTEM + [3], speculation=features)
        assert second.cached_tokens == 64  # ... but it cached them
        assert torch.equal(torch.cat(Features.seen)[:64], full[:64])
        assert second.token_ids == _plain(target, SYSTEM + [3]).token_ids
    finally:
        scheduler.stop()


def test_usage_reports_cached_tokens_and_metrics_count_hits(target):
    config = ServerConfig(target=target, gamma=4, policy="always", prefix_cache_gb=0.25)
    body = {"prompt": SYSTEM + [1], "max_tokens": 8, "temperature": 0}
    with LocalServer(create_app(config)) as running:
        first = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
        second = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(f"{running.url}/metrics", timeout=60).text
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    assert "specdecode:prefix_cache_hits_total 64.0" in metrics
    assert "specdecode:prefix_cache_queries_total 140.0" in metrics
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_prefix_cache_gb_is_checked_and_zero_turns_it_off(target):
    with pytest.raises(ValueError, match="prefix_cache_gb"):
        ServerConfig(prefix_cache_gb=-1)
    from specdecode.serving.batching.prefix_cache import build_prefix_cache

    assert build_prefix_cache(0, target, 4) is None
    assert build_prefix_cache(0.5, target, 4).budget_bytes == 1 << 29


def test_control_corrupted_cached_rows_change_the_logprobs(target):
    scheduler = _scheduler(target, PrefixCache(1 << 30))
    try:
        _run(scheduler, target, SYSTEM + [1])
        with torch.inference_mode():  # the engine is idle: scale layer 0's values of one token per block
            for block in scheduler.prefix_cache._blocks.values():
                block.payload.kv.values[0, ..., 3, :] *= 1.5
        out = _run(scheduler, target, SYSTEM + [2], logprobs=3)
        assert out.cached_tokens == 64
        assert out.logprobs != _plain(target, SYSTEM + [2], logprobs=3).logprobs
    finally:
        scheduler.stop()


def test_cached_prompt_tokens_do_not_count_against_the_prefill_budget(target):
    admitted = {}
    for cache in (None, PrefixCache(1 << 30)):
        decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=4)
        scheduler = Scheduler(decoder, {"lookup": sd.PromptLookupProposer}, SpeculationPolicy("always"), 8,
                              prefill_budget=100, prefix_cache=cache)  # fmt: skip
        for i in range(4):  # queued directly; one admission step on this thread (the engine thread never starts)
            scheduler._waiting.append(Job(Request(target, SYSTEM + [i, i], GREEDY, None), LOOKUP, Waiter()))
        scheduler._admit()
        admitted[cache is None] = [job.request.cached_tokens for job in scheduler._active]
    assert admitted[True] == [0, 0]  # 72 prompt tokens each: the second runs the budget out
    assert admitted[False] == [0, 64, 64, 64]  # 72, then 8 each
