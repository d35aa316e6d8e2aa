"""The engine thread: continuous batching of many requests over one target model, each with its own KV cache.

All model work runs on one background thread. Requests arrive through a thread-safe inbox and wait for a
slot (a runner with its own KV cache, plus the request's proposer state), up to ``max_batch`` at once. Each
step the thread (1) drops requests whose client went away and admits waiting ones (prefill), (2) asks the
policy how many tokens each request drafts, (3) drafts them (``SpeculativeDecoder.draft``), (4) runs ONE
target pass for all of them (the runner's ``forward_batch``: every request's newest token plus its draft; a token tree,
with positions and a mask of its own, runs alone), and (5)
verifies, emits and handles stops per request (``SpeculativeDecoder.verify_round``). A hybrid proposer
(``HybridProposer``: ``eagle+suffix``) says before (2) which side would draft (a copied run or the model's
guesses) and how far; the policy prices that round with that side's acceptance and drafting cost, kept apart
(``eagle+suffix:copy``, ``eagle+suffix:model``), so a head's ~45% never cuts a ~90% copy short. Requests join and leave
between steps. Events (text deltas, the final output, an error) go back through each job's ``deliver``
callback, which the HTTP side makes thread-safe (``loop.call_soon_threadsafe``).

Greedy output does not depend on the batch: the native runner's batched pass gives every row bitwise the
logits of that request's own ``forward`` (row invariance), and verification is per request. A request that
raises (in its proposer, its pass or its verification) fails alone; the others continue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ...control import AcceptanceHistory, RequestAcceptance
from ...engine.decoder import Round, SpeculativeDecoder
from ...engine.prefix_reuse import held_after
from ...engine.provenance import TokenLogprob, TokenSource
from ...engine.request import GenerationOutput, Request
from ...models.runner import ModelRunner
from ...openmp import release_thread_pool
from ...proposers.base import Proposer
from ...proposers.hybrid import HybridProposer
from ..metrics import ServerMetrics
from .policy import Candidate, SpeculationPolicy
from .prefix_cache import CachedRows, PrefixCache

log = logging.getLogger(__name__)
PLAIN = "none"


@dataclass(frozen=True)
class Speculation:
    """How one request speculates: a proposer name (``none`` = plain decoding) and gamma, the most tokens it
    drafts per round (an integer, or ``auto``: up to the scheduler's ``max_gamma``, as the policy decides)."""

    proposer: str
    gamma: int | str


@dataclass(frozen=True)
class Event:
    """What a job reports: ``text`` (a delta; ``completion_tokens`` so far; for a job that wants them, the new
    tokens with their sources and logprobs), ``done`` (the output) or ``error``."""

    kind: str
    text: str = ""
    completion_tokens: int = 0
    output: GenerationOutput | None = None
    error: str = ""
    token_ids: tuple[int, ...] = ()
    sources: tuple[TokenSource, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


class Job:
    """One request inside the scheduler: the engine's request, how it speculates, where its events go;
    ``wants_tokens``: every text event also carries its tokens (their sources, logprobs)."""

    def __init__(
        self,
        request: Request,
        speculation: Speculation,
        deliver: Callable[[Event], None],
        wants_tokens: bool = False,
    ) -> None:
        self.request = request
        self.speculation = speculation
        self.deliver = deliver
        self.wants_tokens = wants_tokens
        self.cancelled = False
        self.arrived = time.perf_counter()
        self.slot: Slot | None = None
        self.proposer: Proposer | None = None
        # its acceptance per book: the proposer's name (``lookup``), a hybrid's per side (``eagle+suffix:copy``)
        self.acceptance: dict[str, RequestAcceptance] = {}
        # who drafted this request's last round (None: a plain step, or none yet). A proposer with state (an EAGLE
        # head's cache, a draft model's) first catches up on the tokens it did not draft, so only a round that
        # follows one drafted by the same proposer (a hybrid: the same side) prices drafting: priced with its
        # catch-ups, a head looked so dear that the policy drafted on 2% of steps (docs/BENCHMARKS.md)
        self.drafted_by: str | None = None
        self.sent_tokens = 0
        self.last_token_at: float | None = None
        self._text: list[str] = []
        request.on_text = self._text.append

    def take_text(self) -> str:
        text = "".join(self._text)
        self._text.clear()
        return text


class Slot:
    """A runner with its own KV cache and, lazily, one proposer of each kind (their own draft caches)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.proposers: dict[str, Proposer] = {}


_WAKE = object()
_STOP = object()


@dataclass(frozen=True)
class _Close:
    """Shutting down: requests in the engine may run until ``deadline`` (``time.monotonic()``), then end."""

    deadline: float


class Scheduler:
    """Runs ``Job``s on one background thread; ``submit`` and ``cancel`` may be called from any thread."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        proposers: Mapping[str, Callable[[], Proposer]],
        policy: SpeculationPolicy,
        max_batch: int = 16,
        max_gamma: int = 8,
        metrics: ServerMetrics | None = None,
        prefill_budget: int = 512,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.decoder = decoder
        self.target = decoder.target
        self.proposers = dict(proposers)
        self.policy = policy
        self.max_batch = max_batch
        self.max_gamma = max_gamma
        self.prefill_budget = prefill_budget
        self.metrics = metrics or ServerMetrics()
        self.prefix_cache = prefix_cache  # KV rows of earlier and running requests, by token prefix
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._free: list[Slot] = []  # every slot is either in a job or here: at most max_batch
        self._slots = 0  # slots created
        self._acceptance: dict[str, AcceptanceHistory] = {}  # per book: the server's memory across requests
        self._stopping = False
        self._deadline: float | None = None  # set by close(): when the requests still running are ended
        self.cut = 0  # requests ended at the deadline or at stop(), before their own end
        self._speculated = False  # whether the last step drafted anything
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)

    # --- any thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread. The calling thread's OpenMP pool is freed first (``openmp``): with two pools
        on the CPUs, every torch parallel region of the engine paid a wake-up — its forwards ran 3x slower."""
        release_thread_pool()
        self._thread.start()

    def close(self, grace: float) -> None:
        """Shutting down: requests already in the engine (running or waiting) get ``grace`` seconds to finish, then
        each ends with what it has (``finish_reason`` length, its final event), as does any arriving later."""
        self._inbox.put(_Close(time.monotonic() + grace))

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current step, end what is left (as at ``close``'s deadline) and end the thread."""
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        if job.speculation.proposer != PLAIN and job.speculation.proposer not in self.proposers:
            raise ValueError(f"unknown proposer {job.speculation.proposer!r}")
        self._inbox.put(job)

    def status(self) -> dict[str, bool | int]:
        """Whether the engine is speculating (its last step drafted, and requests are running), and the running
        and waiting request counts (a snapshot)."""
        running = len(self._active)
        return {"speculating": self._speculated and running > 0, "running": running, "waiting": len(self._waiting)}

    def forget_learned(self) -> None:
        """Drop what the engine has learned across requests (each proposer's acceptance prior and draft cost):
        the next requests start as the first ones did. For benchmarks that compare policies one after another
        (call it while idle)."""
        self._acceptance = {}
        self.policy.costs.forget_drafting()

    def cancel(self, job: Job) -> None:
        """The client went away: free the job's slot and KV cache at the next step boundary."""
        job.cancelled = True
        self._inbox.put(_WAKE)

    # --- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._drain(block=not (self._active or self._waiting))
            try:
                self._drop_cancelled()
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._cut_all()
                self._admit()
                if self._active:
                    self._step()
            except Exception:  # a bug outside any one request: fail the batch, keep serving
                log.exception("engine step failed")
                for job in [*self._active]:
                    self._fail(job, "internal error in the engine step")
            self.metrics.running.set(len(self._active))
            self.metrics.waiting.set(len(self._waiting))
            self._count_slots()
        self._cut_all()

    def _cut_all(self) -> None:
        """End every request in the engine now, each with the tokens it has: ``finish_reason`` length (cut short),
        its final event, its prompt and answer handed to a proposer that remembers them."""
        for job in [*self._active, *self._waiting]:
            if job.cancelled:
                self._release(job)
                continue
            self.cut += 1
            try:
                self._finish(job)
            except Exception as exc:
                self._fail(job, exc)

    def _drain(self, block: bool) -> None:
        item = self._inbox.get() if block else None
        while True:
            if item is _STOP:
                self._stopping = True
            elif isinstance(item, _Close):
                self._deadline = min(item.deadline, self._deadline or item.deadline)
            elif isinstance(item, Job):
                self._waiting.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        for job in [j for j in (*self._waiting, *self._active) if j.cancelled]:
            self.metrics.aborted.inc()
            self._release(job)

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, up to ``prefill_budget`` prompt tokens per step (at least
        one request; tokens the prefix cache supplies are free): a burst of arrivals then stalls the running
        requests a little, several times, rather than once for every prompt."""
        budget = self.prefill_budget
        while self._waiting and len(self._active) < self.max_batch and budget > 0:
            job = self._waiting.popleft()
            job.slot = self._free.pop() if self._free else self._new_slot()
            self._active.append(job)
            try:
                name = job.speculation.proposer
                if name != PLAIN:
                    if name not in job.slot.proposers:
                        job.slot.proposers[name] = self.decoder.bind_proposer(self.proposers[name]())
                    job.proposer = job.slot.proposers[name]
                # an EAGLE head drafts from the target's features: the runner keeps them for this request
                job.slot.runner.capture_hidden = job.proposer is not None and job.proposer.needs_target_hidden
                self._prefill(job)
            except Exception as exc:
                self._fail(job, exc)
                continue
            self.metrics.prompt_tokens.inc(len(job.request.prompt_ids))
            budget -= len(job.request.prompt_ids) - job.request.cached_tokens

    def _prefill(self, job: Job) -> None:
        """Prefill the job's prompt into its slot: its longest cached prefix copied in (``prefix_cache``), the rest
        computed — bitwise the cache a full prefill gives (``Request.prefill``); then cache the prompt's whole
        blocks, so that requests arriving while it runs share them too."""
        request, runner, cache = job.request, job.slot.runner, self.prefix_cache
        if cache is None or not runner.exact_prefix_reuse:
            request.prefill(runner)
            return
        capture = runner.capture_hidden  # an EAGLE head's request reuses only blocks that carry the features
        prompt = request.context[:-1]
        blocks = cache.match(prompt, lambda rows: rows.hidden is not None or not capture)
        runner.reset()
        for block in blocks:
            runner.append_rows(block.payload.kv)
        hidden = torch.cat([block.payload.hidden for block in blocks]) if capture and blocks else None
        request.prefill(runner, runner.length, hidden)
        self.metrics.prefix_cache_queries.inc(len(prompt))
        self.metrics.prefix_cache_hits.inc(request.cached_tokens)
        self._keep_blocks(job)

    def _keep_blocks(self, job: Job) -> None:
        """Copy the whole blocks of what the job's runner holds into the prefix cache (features too, if captured)."""
        if self.prefix_cache is None or job.slot is None or not job.slot.runner.exact_prefix_reuse:
            return
        runner = job.slot.runner
        held = held_after(job.request, runner)
        hidden = held.hidden

        def rows(start: int, end: int) -> CachedRows:
            return CachedRows(runner.export_rows(start, end), None if hidden is None else hidden[start:end].clone())

        self.prefix_cache.insert(held.tokens, rows, replace=lambda cached: hidden is not None and cached.hidden is None)
        self.metrics.prefix_cache_bytes.set(self.prefix_cache.bytes)

    def _new_slot(self) -> Slot:
        self._slots += 1
        return Slot(self.target.new_runner())

    def _count_slots(self) -> None:
        """The slot gauges. Invariant: every slot is in exactly one running job or in the pool (so at most
        ``max_batch`` exist), and a pooled slot's cache is empty."""
        held = [job.slot for job in self._active if job.slot is not None]
        if len(held) + len(self._free) != self._slots:
            log.error("slot pool lost track: %d created, %d held, %d free", self._slots, len(held), len(self._free))
        self.metrics.slots.set(self._slots)
        self.metrics.free_slots.set(len(self._free))
        self.metrics.cache_tokens.set(sum(slot.runner.length for slot in (*held, *self._free)))

    def _books(self, job: Job, name: str) -> RequestAcceptance:
        """The request's acceptance for book ``name``, on the server's memory of that book."""
        if name not in job.acceptance:
            job.acceptance[name] = RequestAcceptance(self._acceptance.setdefault(name, AcceptanceHistory()))
        return job.acceptance[name]

    def _candidate(self, job: Job) -> tuple[Candidate, RequestAcceptance | None]:
        """What the policy sees of ``job`` (the estimator's optimistic acceptance, as ``gamma="auto"`` reads it)
        and the books it was read from."""
        if job.proposer is None:
            return Candidate(0, ()), None
        name, gamma = job.speculation.proposer, job.speculation.gamma
        cap = max(0, min(self.max_gamma if gamma == "auto" else gamma, job.request.sink.remaining - 1))
        if cap and isinstance(job.proposer, HybridProposer):
            # a hybrid: the side that would draft (a copy or a model) and its length, priced by that side's books
            side, length = job.proposer.preview(job.request.context, cap)
            name, cap = f"{name}:{side}", min(cap, length)
        books = self._books(job, name)
        draft_seconds = self.policy.costs.draft_token_seconds.get(name, 0.0)
        return Candidate.of(cap, books, draft_seconds), books

    def _step(self) -> None:
        candidates = [self._candidate(job) for job in self._active]
        plan = self.policy.plan([candidate for candidate, _ in candidates])
        for (candidate, books), k in zip(candidates, plan.draft_lengths, strict=True):
            if plan.priced and books is not None and candidate.cap and not k:  # plain verdict: evidence ages
                books.fade_toward_memory()
        rounds: list[tuple[Job, Round]] = []
        for job, k in zip(list(self._active), plan.draft_lengths, strict=True):
            try:
                rounds.append((job, self.decoder.draft(job.request, job.proposer, k)))
            except Exception as exc:
                self._fail(job, exc)
        if not rounds:
            return
        started = time.perf_counter()
        logits = self._forward(rounds)
        seconds = time.perf_counter() - started
        rows = sum(int(this_round.tokens.shape[0]) for _, this_round in rounds)
        if all(x is not None for x in logits):
            self.policy.costs.observe_pass(rows, seconds)
            self.metrics.pass_seconds.labels(str(rows)).set(self.policy.costs.seconds[rows])
        speculating = self._speculated = rows > len(rounds)
        self.metrics.speculating.set(int(speculating))
        self.metrics.steps.labels(str(speculating).lower()).inc()
        self.metrics.planned_draft_tokens.set(plan.rows - len(plan.draft_lengths))
        self.metrics.predicted_speedup.set(plan.predicted_speedup)
        for (job, this_round), job_logits in zip(rounds, logits, strict=True):
            if job_logits is not None:
                self._verify_round(job, this_round, job_logits, started)

    def _forward(self, rounds: list[tuple[Job, Round]]) -> list[torch.Tensor | None]:
        """The target's logits for every round (None: the request failed): the chains in one batched pass, token
        trees (their own positions and mask) one by one.

        A pass that raises fails the requests it computes, and only those: the engine thread goes on with the
        others (any exception, as docs/SERVING.md promises a request that fails inside the engine fails alone). The
        batched pass is one computation for all its rows, so its failure is every chain's (a batching bug shows
        in each of their answers, never hidden behind a retry)."""
        out: list[torch.Tensor | None] = [None] * len(rounds)
        chains = [i for i, (_, this_round) in enumerate(rounds) if this_round.positions is None]
        alone = [i for i, (_, this_round) in enumerate(rounds) if this_round.positions is not None]
        try:
            runners = [rounds[i][0].slot.runner for i in chains]
            chunks = [rounds[i][1].tokens for i in chains]
            for i, logits in zip(chains, runners[0].forward_batch(runners, chunks) if chains else [], strict=True):
                out[i] = logits
        except Exception as exc:
            for i in chains:
                self._fail(rounds[i][0], exc)
        for i in alone:
            job, this_round = rounds[i]
            runner = job.slot.runner
            try:
                runner.rollback_to(len(job.request.context) - 1)
                out[i] = this_round.score(runner)
            except Exception as exc:
                self._fail(job, exc)
        return out

    def _verify_round(self, job: Job, this_round: Round, logits: torch.Tensor, started: float) -> None:
        stats = job.request.stats
        accepted_before = stats.accepted
        try:
            self.decoder.verify_round(job.request, this_round, logits, job.slot.runner, started)
        except Exception as exc:
            self._fail(job, exc)
            return
        drafted, accepted = len(this_round.draft) - this_round.forced, stats.accepted - accepted_before  # forced: apart
        name = None
        if drafted:
            name = job.speculation.proposer
            if isinstance(job.proposer, HybridProposer):  # the books of the side that drafted
                name = f"{name}:{job.proposer.last_side}"
            self._books(job, name).observe(drafted, accepted)
            if job.drafted_by == name:  # else the time holds a catch-up (see Job.drafted_by), not a price
                self.policy.costs.observe_draft(drafted, this_round.draft_seconds, name)
        job.drafted_by = name
        self.metrics.observe_round(drafted, accepted)
        self._emit(job)
        if job.request.done:
            self._finish(job)

    def _emit(self, job: Job) -> None:
        """Send the text accepted this step (and, if wanted, its tokens); record time to first token and
        inter-token latency."""
        now = time.perf_counter()
        request = job.request
        total = len(request.sink.token_ids)
        sent = job.sent_tokens
        new = total - sent
        if new <= 0:
            return
        if job.last_token_at is None:
            self.metrics.ttft.observe(now - job.arrived)
        else:
            gap = (now - job.last_token_at) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self.metrics.generation_tokens.inc(new)
        job.sent_tokens, job.last_token_at = total, now
        text = job.take_text()
        if job.wants_tokens:
            logprobs = None if request.logprobs is None else tuple(request.logprobs[sent:total])
            tokens = tuple(request.sink.token_ids[sent:total])
            job.deliver(
                Event(
                    "text", text, total, token_ids=tokens, sources=tuple(request.sources[sent:total]), logprobs=logprobs
                )
            )
        elif text:
            job.deliver(Event("text", text, total))

    def _finish(self, job: Job) -> None:
        self.decoder.end_request(job.request, job.proposer)
        self._keep_blocks(job)
        output = job.request.finish()
        self.metrics.finished.labels("length" if output.finish_reason == "length" else "stop").inc()
        self.metrics.e2e.observe(time.perf_counter() - job.arrived)
        self._release(job)
        job.deliver(Event("done", "", len(output.token_ids), output))

    def _fail(self, job: Job, error: Exception | str) -> None:
        if isinstance(error, Exception):
            log.error("request failed", exc_info=error)
            error = f"{type(error).__name__}: {error}"
        self.metrics.failed.inc()
        self._release(job)
        job.deliver(Event("error", error=error))

    def _release(self, job: Job) -> None:
        """Take the job out of the batch or the queue; its slot's cache is emptied and pooled for reuse."""
        if job in self._active:
            self._active.remove(job)
        elif job in self._waiting:
            self._waiting.remove(job)
        if job.slot is not None:
            job.slot.runner.reset()
            self._free.append(job.slot)
            job.slot = None
        job.proposer = None
