"""Prometheus metrics of one server, named after vLLM's (``vllm:…`` → ``specdecode:…``), in a registry of its own."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no *_created series: half of /metrics would be timestamps nobody reads

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """Everything /metrics shows; updated by the engine thread (prometheus_client is thread-safe)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, cpu seconds, open fds
        r = self.registry
        self.running = Gauge(
            "specdecode:num_requests_running", "Requests in the batch (each holds a KV cache).", registry=r
        )
        self.waiting = Gauge("specdecode:num_requests_waiting", "Requests queued for a free slot.", registry=r)
        self.slots = Gauge(
            "specdecode:kv_slots", "Slots created (a runner with its KV cache each): at most max_batch.", registry=r
        )
        self.free_slots = Gauge("specdecode:kv_slots_free", "Slots pooled, their caches empty.", registry=r)
        self.cache_tokens = Gauge(
            "specdecode:kv_cache_tokens", "Tokens held in the slots' KV caches (0 when idle).", registry=r
        )
        self.prompt_tokens = Counter("specdecode:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("specdecode:generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter(
            "specdecode:request_success",
            "Requests finished, by finish reason (stop, length).",
            ["finished_reason"],
            registry=r,
        )
        self.aborted = Counter("specdecode:request_aborted", "Requests whose client went away.", registry=r)
        self.failed = Counter("specdecode:request_failure", "Requests that failed inside the engine.", registry=r)
        self.ttft = Histogram(
            "specdecode:time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "specdecode:inter_token_latency_seconds",
            "Time between a request's tokens (a step's gap spread over the tokens it emitted).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specdecode:e2e_request_latency_seconds", "Arrival to last token.", buckets=E2E_BUCKETS, registry=r
        )
        self.prefix_cache_queries = Counter(
            "specdecode:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "specdecode:prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.", registry=r
        )
        self.prefix_cache_bytes = Gauge(
            "specdecode:prefix_cache_bytes", "KV bytes held by the prefix cache.", registry=r
        )
        self.drafts = Counter("specdecode:spec_decode_num_drafts", "Rounds that verified a draft.", registry=r)
        self.draft_tokens = Counter("specdecode:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted_tokens = Counter(
            "specdecode:spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r
        )
        self.accepted_per_position = Counter(
            "specdecode:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first guess).",
            ["position"],
            registry=r,
        )
        self.speculating = Gauge(
            "specdecode:spec_decode_enabled", "1 if the last step speculated, 0 if it was a plain step.", registry=r
        )
        self.planned_draft_tokens = Gauge(
            "specdecode:spec_decode_planned_draft_tokens",
            "Draft tokens the policy planned for the last step.",
            registry=r,
        )
        self.predicted_speedup = Gauge(
            "specdecode:spec_decode_predicted_speedup",
            "The policy's predicted tokens/s of the last step's plan over a plain step.",
            registry=r,
        )
        self.steps = Counter(
            "specdecode:engine_steps", "Batched target passes, by whether they speculated.", ["speculating"], registry=r
        )
        self.pass_seconds = Gauge(
            "specdecode:batch_pass_seconds",
            "The policy's measured cost table: seconds of a batched target pass by its rows.",
            ["rows"],
            registry=r,
        )

    def observe_round(self, drafted: int, accepted: int) -> None:
        """One request's verified round."""
        if drafted:
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_position.labels(str(position)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
