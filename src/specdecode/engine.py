"""The speculative decoding loop and the plain autoregressive baseline, over the same runner and sampling."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .adaptive import AcceptanceMemory, AdaptiveGamma, CostModel, HybridGamma
from .keyed_noise import KeyedNoise
from .models.base import ModelRunner
from .models.loader import LoadedModel, load_model
from .output import OutputSink
from .params import SamplingParams
from .proposers.base import EMPTY_DRAFT, CoupledProposer, Draft, Proposer
from .proposers.prompt_lookup import PromptLookupProposer
from .provenance import MAX_TOP_LOGPROBS, TokenLogprob, TokenSource, round_sources, token_logprobs
from .sampling import probs_from_logits
from .stats import DecodeStats
from .structured import Constraint, cut_at_forbidden, mask_logits, with_forced
from .tree import attention_mask, children, depths, prune_depth
from .verify import (
    coupled_verify,
    greedy_verify,
    speculative_sample,
    tree_coupled_verify,
    tree_greedy_verify,
    tree_speculative_sample,
)
from .vocab import check_vocabularies, vocabulary_fingerprint
from .warps import RowContexts, target_logits

TextCallback = Callable[[str], None]
FORCED_PER_ROUND = 32  # tokens a grammar forces that one round drafts for free, at most


@dataclass
class GenerationOutput:
    """Result of one request: generated ids (EOS included if it ended generation), text, seed and stats;
    per token its source (an accepted guess or the target's own) and, if asked for, its logprobs."""

    token_ids: list[int]
    text: str
    seed: int
    stats: DecodeStats
    finish_reason: str
    prompt_ids: list[int]
    sources: list[TokenSource] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Round:
    """A round in flight: its draft, the chunk the target scores (newest context token + draft), drafting time;
    for a token tree also the chunk's positions and attention mask (None for a chain); under a grammar, the mask
    of each scored row and how many leading draft tokens the grammar forced (drafted for free)."""

    draft: Draft
    tokens: torch.Tensor
    draft_seconds: float
    positions: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    forced: int = 0


def fresh_seed() -> int:
    """A seed from the OS's entropy, in [0, 2**63)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def check_context_window(target: LoadedModel, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a request that would run past the positions the model was trained on, or past the tokens its KV cache
    may hold (``max_context``): prompt + new ≤ ``target.context_window``."""
    window = target.context_window
    if window is None or prompt_tokens + max_new_tokens <= window:
        return
    fix = (
        f"lower max_new_tokens to at most {window - prompt_tokens} or shorten the prompt"
        if prompt_tokens < window
        else f"shorten the prompt so that prompt + max_new_tokens is at most {window}"
    )
    raise ValueError(
        f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) is "
        f"{prompt_tokens + max_new_tokens} tokens, past {_limit(target, window)}: {fix}"
    )


def _limit(target: LoadedModel, window: int) -> str:
    """What caps a sequence of ``target`` at ``window`` tokens, in words."""
    if target.max_context == window:
        return f"the {window} tokens a sequence may hold (max_context, --max-context)"
    return f"{target.name}'s context window of {window} positions (max_position_embeddings)"


def _check_logprobs(logprobs: int | None) -> None:
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_TOP_LOGPROBS
    ):
        raise ValueError(f"logprobs must be None or an integer in 0..{MAX_TOP_LOGPROBS}, got {logprobs!r}")


class Request:
    """Per-request state shared by both loops (and the server's scheduler): context, output sink, generator,
    stats, stream callback; each kept token's source and (``logprobs`` not None: with that many alternatives)
    its logprobs."""

    def __init__(
        self,
        target: LoadedModel,
        prompt: str | list[int],
        params: SamplingParams,
        on_text: TextCallback | None,
        logprobs: int | None = None,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        _check_logprobs(logprobs)
        if params.stop and target.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model was loaded without one")
        if params.logit_bias and params.logit_bias[-1][0] >= target.vocab_size:
            raise ValueError(
                f"logit_bias names token {params.logit_bias[-1][0]}, past the vocabulary ({target.vocab_size} tokens)"
            )
        self.prompt_ids = target.encode(prompt)
        check_context_window(target, len(self.prompt_ids), params.max_new_tokens)
        self.context = list(self.prompt_ids)
        self.params = params
        self.seed = fresh_seed() if params.seed is None else params.seed
        self.generator = torch.Generator().manual_seed(self.seed)
        self.noise = KeyedNoise(self.seed)
        self.sink = OutputSink(target.decode, target.eos_token_ids, params.max_new_tokens, params.stop)
        self.stats = DecodeStats()
        self.on_text = on_text
        self.controller: AdaptiveGamma | HybridGamma | None = None
        self.started = time.perf_counter()
        # The target's verified features, in position order (rows of passes over a capture_hidden runner).
        self.target_hidden: list[torch.Tensor] = []
        self.sources: list[TokenSource] = []
        self.top_logprobs = logprobs
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        self.constraint: Constraint | None = None
        if params.grammar is not None:
            self.constraint = Constraint(params.grammar, target.tokenizer, target.vocab_size, target.eos_token_ids)

    def prefill(self, runner) -> None:
        """Fill the cache with every prompt token but the last, which leads the first round."""
        t0 = time.perf_counter()
        runner.reset()
        if len(self.context) > 1:
            runner.prefill(torch.tensor(self.context[:-1], dtype=torch.int64))
            self.keep_hidden(runner, slice(None))
        self.stats.prefill_seconds += time.perf_counter() - t0

    def keep_hidden(self, runner, rows: slice | list[int]) -> None:
        """Record the features of the last pass's ``rows`` (verified tokens) if the runner captures them."""
        if getattr(runner, "capture_hidden", False):
            self.target_hidden.append(runner.hidden[rows])

    def emit(self, tokens: list[int], sources: list[TokenSource], rows: torch.Tensor) -> int:
        """Append tokens up to the first stop condition, with their ``sources`` and (if asked) the logprobs
        from ``rows``, the target's logits row that chose each token; stream new text; return how many were
        kept."""
        if self.constraint is not None:  # the grammar's end ends the output; what the sink cuts, it forgets
            tokens = tokens[: self.constraint.advance(tokens)]
        kept = self.sink.push(tokens)
        if self.constraint is not None:
            self.constraint.rollback(len(tokens) - kept)
            if self.constraint.ended and self.sink.finish_reason is None:
                self.sink.finish_reason = "stop"
        self.context.extend(self.sink.token_ids[len(self.sink.token_ids) - kept :])
        self.sources.extend(sources[:kept])
        if self.logprobs is not None:
            self.logprobs.extend(token_logprobs(rows[:kept], tokens[:kept], self.top_logprobs))
        if self.on_text is not None:
            delta = self.sink.take_delta()
            if delta:
                self.on_text(delta)
        return kept

    def target_logits(
        self,
        logits: torch.Tensor,
        draft_tokens: torch.Tensor | None = None,
        parents: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The target's ``logits`` of a pass over the newest context token and ``draft_tokens`` (a tree: with
        ``parents``; None: a plain step), each row warped with its own context (``warps.target_logits``), then
        masked by the grammar: ``allowed`` [rows, V], a round's masks (``Round.allowed``); a plain step under a
        grammar takes its current mask."""
        if draft_tokens is None and self.constraint is not None:
            allowed = self.constraint.mask().unsqueeze(0)
        drafted = torch.zeros(0, dtype=torch.int64) if draft_tokens is None else draft_tokens
        rows = RowContexts(self.context, len(self.prompt_ids), drafted, parents)
        return mask_logits(target_logits(logits, self.params, rows), allowed)

    @property
    def done(self) -> bool:
        return self.sink.finish_reason is not None

    def finish(self) -> GenerationOutput:
        self.stats.generated = len(self.sink.token_ids)
        self.stats.total_seconds = time.perf_counter() - self.started
        return GenerationOutput(
            list(self.sink.token_ids),
            self.sink.text,
            self.seed,
            self.stats,
            self.sink.finish_reason or "length",
            self.prompt_ids,
            list(self.sources),
            None if self.logprobs is None else list(self.logprobs),
        )


class SpeculativeDecoder:
    """Draft up to ``gamma`` tokens, score them in one target pass, keep the longest acceptable run + 1.

    ``gamma="auto"`` (the default) chooses each round's draft length (≤ ``max_gamma``) from the acceptance and
    step costs measured so far, and 0 — a plain round — where speculation does not pay, probing with one guess
    at doubling intervals (``adaptive``), so a proposer that is never right costs little over plain decoding.
    An integer drafts that many tokens every round (fewer only near the token budget), paying or not.

    Cache invariant between rounds: the target's cache holds every context token but the newest, which
    leads the next round's forward pass ahead of the draft tokens.

    ``mode="exact"`` verifies with min(1, p/q) and the request's generator: every token is distributed as
    the target's, but the text differs from plain decoding with the same seed. ``mode="reproducible"``
    verifies with the keyed noise plain decoding uses (``keyed_noise``, ``verify.coupled_verify``): the
    output equals ``autoregressive_generate`` with the same seed, token for token.

    A proposer may return a token tree (``Draft.parents``): the target scores every node in one pass (depth
    positions; each node attends to the cache, the newest token and its ancestors), the mode's tree rule
    keeps one root path, and ``runner.retain`` keeps that path's cache entries. ``gamma`` then bounds the
    tree's depth (the tokens a round can accept); the proposer chooses the width. Under ``gamma="auto"`` a
    proposer with ``chooses_length`` (``HybridProposer``) gets a controller a side (``HybridGamma``).
    """

    def __init__(
        self,
        target: LoadedModel,
        proposer: Proposer | None = None,
        gamma: int | str = "auto",
        max_gamma: int = 8,
        mode: str = "exact",
    ) -> None:
        if mode not in ("exact", "reproducible"):
            raise ValueError(f"mode must be 'exact' or 'reproducible', got {mode!r}")
        if gamma != "auto" and (isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1):
            raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
        self.target = load_model(target)
        self.gamma = gamma
        self.max_gamma = max_gamma
        self.mode = mode
        self.costs = CostModel()
        # gamma="auto": acceptance carried across requests, per drafter ("" the proposer, a hybrid's sides)
        self.acceptance_memories: dict[str, AcceptanceMemory] = {"": AcceptanceMemory(max_gamma)}
        self.last_output: GenerationOutput | None = None
        self.use_proposer(PromptLookupProposer() if proposer is None else proposer)

    def use_proposer(self, proposer: Proposer) -> None:
        """Draft with ``proposer`` from the next request on, keeping what this decoder has measured (the target's
        costs, ``gamma="auto"``'s acceptance memory) and its runner, as a long-lived decoder does."""
        draft_model = getattr(proposer, "model", None)
        if isinstance(draft_model, LoadedModel):
            check_vocabularies(self.target, draft_model)
        self.proposer = proposer
        if "_runner" in self.__dict__:  # allocated: an EAGLE head reads the features it captures
            self._runner.capture_hidden = getattr(proposer, "needs_target_hidden", False)
        self.bind_proposer(proposer)

    def bind_proposer(self, proposer: Proposer | None) -> None:
        """Give a proposer that asks for them (``bind_target``) the target's vocabulary and the measured costs."""
        bind = getattr(proposer, "bind_target", None)
        if bind is not None:
            bind(vocabulary_fingerprint(self.target), self.costs, self.target.vocab_size)

    def end_request(self, request: Request, proposer: Proposer | None) -> None:
        """Tell a proposer that remembers requests (``end_request``) that ``request`` ended."""
        remember = getattr(proposer, "end_request", None)
        if remember is not None:
            remember(request.context)

    @functools.cached_property
    def _runner(self) -> ModelRunner:
        """The target's runner for generate/stream, allocated on first use (the server brings its own)."""
        runner = self.target.new_runner()
        runner.capture_hidden = getattr(self.proposer, "needs_target_hidden", False)  # an EAGLE head reads them
        return runner

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        on_text: TextCallback | None = None,
        logprobs: int | None = None,
    ) -> GenerationOutput:
        """Generate from ``prompt``; ``on_text`` receives text as soon as tokens are accepted; ``logprobs``
        (0..20 alternatives) records each token's logprobs under the target (``provenance``)."""
        params = SamplingParams() if params is None else params
        request = self._start(prompt, params, on_text, logprobs)
        while not request.done:
            self._round(request)
        self.end_request(request, self.proposer)
        return request.finish()

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None, logprobs: int | None = None
    ) -> Iterator[str]:
        """Yield text pieces as they are accepted; afterwards ``last_output`` holds the full result."""
        chunks: list[str] = []
        params = SamplingParams() if params is None else params
        request = self._start(prompt, params, chunks.append, logprobs)
        while not request.done:
            self._round(request)
            yield from chunks
            chunks.clear()
        self.end_request(request, self.proposer)
        self.last_output = request.finish()

    def _start(
        self, prompt: str | list[int], params: SamplingParams, on_text: TextCallback | None, logprobs: int | None
    ) -> Request:
        request = Request(self.target, prompt, params, on_text, logprobs)
        if self.gamma == "auto" and getattr(self.proposer, "chooses_length", False):
            request.controller = HybridGamma.for_request(
                self.proposer, request.context, self.max_gamma, self.costs, self.acceptance_memories
            )
        elif self.gamma == "auto":
            request.controller = AdaptiveGamma(self.max_gamma, self.costs, self.acceptance_memories[""])
        request.prefill(self._runner)
        return request

    def _round(self, request: Request) -> None:
        controller = request.controller
        k = min(self.gamma if controller is None else controller.choose(), request.sink.remaining - 1)
        pending = self.draft(request, self.proposer, k)
        started = time.perf_counter()
        if pending.positions is None:
            logits = self._runner.forward(pending.tokens)
        else:
            logits = self._runner.forward(pending.tokens, positions=pending.positions, attn_mask=pending.attn_mask)
        self.settle(request, pending, logits, self._runner, started)

    def draft(self, request: Request, proposer: Proposer | None, k: int) -> Round:
        """Propose at most ``k`` tokens after the request's context (``proposer`` None: a plain step); a
        tree is cut to depth ``k`` and gets its positions (node i at slot len(context) + i) and mask. Under a
        grammar, the tokens it forces lead the draft (beyond ``k``) and each scored row gets its mask."""
        t0 = time.perf_counter()
        context, params = request.context, request.params
        forced = []  # tokens the grammar forces: drafted for free, past gamma, within the token budget
        if request.constraint is not None:
            forced = request.constraint.forced(min(FORCED_PER_ROUND, request.sink.remaining - 1))
            context, k = context + forced, min(k, request.sink.remaining - 1 - len(forced))
        if getattr(proposer, "needs_target_hidden", False):  # an EAGLE head: the features verified so far
            proposer.observe_target(request.target_hidden)
        if proposer is None:
            draft = EMPTY_DRAFT
        elif self.mode == "reproducible" and isinstance(proposer, CoupledProposer):
            draft = proposer.propose_coupled(context, k, params, request.noise)
        else:
            draft = proposer.propose(context, k, params, request.generator)
        if draft.is_tree:  # a proposer must never push a round past gamma or the token budget
            draft = prune_depth(draft, k)
        if not draft.is_tree and len(draft) > k:
            draft = draft.truncated(k)
        draft, context = with_forced(forced, draft), request.context
        if request.constraint is not None and not draft.is_tree:
            draft, allowed, scored = cut_at_forbidden(request.constraint, draft)
            tokens = torch.cat([torch.tensor(context[-1:], dtype=torch.int64), draft.tokens[:scored]])
            return Round(draft, tokens, time.perf_counter() - t0, allowed=allowed, forced=len(forced))
        tokens = torch.cat([torch.tensor(context[-1:], dtype=torch.int64), draft.tokens])
        if not draft.is_tree:
            return Round(draft, tokens, time.perf_counter() - t0)
        cached = len(context) - 1  # the newest context token sits at slot `cached`
        positions = cached + torch.cat([torch.zeros(1, dtype=torch.int64), depths(draft.parents)])
        mask = attention_mask(draft.parents, cached)
        allowed = None
        if request.constraint is not None:
            allowed = request.constraint.tree_masks(draft.tokens.tolist(), draft.parents.tolist())
        return Round(draft, tokens, time.perf_counter() - t0, positions, mask, allowed, len(forced))

    def settle(
        self, request: Request, pending: Round, logits: torch.Tensor, runner: ModelRunner, started: float
    ) -> None:
        """Verify a round given the target's ``logits`` for its chunk (``runner`` scored it from time
        ``started``): record stats, emit the kept tokens, roll the runner's cache back to context − 1."""
        logits = every_row(pending, logits)
        if pending.positions is not None:
            self._settle_tree(request, pending, logits, runner, started)
            return
        params, context, stats, controller = request.params, request.context, request.stats, request.controller
        draft = pending.draft
        n_drafted = len(draft)
        warped = request.target_logits(logits, draft.tokens, allowed=pending.allowed)
        if params.greedy:
            n_accepted, token = greedy_verify(warped, draft.tokens)
        elif self.mode == "reproducible":
            target_tokens = request.noise.tokens(warped, params, len(context))
            n_accepted, token = coupled_verify(target_tokens, draft.tokens)
        else:
            target_probs = probs_from_logits(warped, params)
            n_accepted, token = speculative_sample(target_probs, draft.probs, draft.tokens, request.generator)
        t2 = time.perf_counter()
        stats.draft_seconds += pending.draft_seconds
        stats.verify_seconds += t2 - started
        guessed, kept = n_drafted - pending.forced, n_accepted - pending.forced  # forced tokens: counted apart
        stats.forced += pending.forced
        stats.record_round(guessed, kept)
        if controller is not None:
            controller.observe(guessed, kept)
            draft_price = None if controller.catching_up else pending.draft_seconds
            self.costs.observe(len(pending.tokens), t2 - started, guessed, draft_price, controller.drafter)
        request.keep_hidden(runner, slice(0, n_accepted + 1))  # the newest context token's row and the accepted
        sources = round_sources(n_accepted, n_drafted > 0, n_accepted < n_drafted)
        request.emit(draft.tokens[:n_accepted].tolist() + [token], sources, logits[: n_accepted + 1])
        runner.rollback_to(len(context) - 1)

    def _settle_tree(
        self, request: Request, pending: Round, logits: torch.Tensor, runner: ModelRunner, started: float
    ) -> None:
        """``settle`` for a token tree: the mode's tree rule picks a root path; ``runner`` retains its entries."""
        params, context, stats, controller = request.params, request.context, request.stats, request.controller
        draft = pending.draft
        warped = request.target_logits(logits, draft.tokens, draft.parents, pending.allowed)
        if params.greedy:
            accepted, token = tree_greedy_verify(warped, draft.tokens, draft.parents)
        elif self.mode == "reproducible":
            target_tokens = request.noise.tokens_at(warped, params, (pending.positions + 1).tolist())
            accepted, token = tree_coupled_verify(target_tokens, draft.tokens, draft.parents)
        else:
            target_probs = probs_from_logits(warped, params)
            accepted, token = tree_speculative_sample(
                target_probs, draft.probs, draft.tokens, draft.parents, request.generator
            )
        t2 = time.perf_counter()
        kids = children(draft.parents)  # kids[0]: the root's children, kids[i + 1]: node i's
        rejected = bool(kids[accepted[-1] + 1 if accepted else 0])  # the path stopped at a fork
        siblings = sum(node != kids[int(draft.parents[node]) + 1][0] for node in accepted)
        nodes_per_depth = torch.bincount(pending.positions[1:] - pending.positions[0])[1:].tolist()
        stats.draft_seconds += pending.draft_seconds
        stats.verify_seconds += t2 - started
        stats.forced += pending.forced  # the forced chain leads the tree: counted apart
        kept = len(accepted) - pending.forced
        stats.record_tree_round(nodes_per_depth[pending.forced :], kept, rejected, siblings)
        if controller is not None:
            controller.observe(kept + rejected, kept)
            controller.observe_tree(len(draft) + 1, pending.draft_seconds)
            draft_price = None if controller.catching_up else pending.draft_seconds
            self.costs.observe(len(draft) + 1, t2 - started, len(draft), draft_price, controller.drafter)
        start = len(context)  # node i sits at slot start + i
        path_rows = [0] + [node + 1 for node in accepted]  # the rows that chose the emitted tokens
        request.keep_hidden(runner, path_rows)
        sources = round_sources(len(accepted), True, rejected)
        chosen_by = logits[path_rows] if request.logprobs is not None else logits  # gather only when read
        request.emit(draft.tokens[accepted].tolist() + [token], sources, chosen_by)
        runner.retain(start, [start + node for node in accepted])


def every_row(pending: Round, logits: torch.Tensor) -> torch.Tensor:
    """The target's ``logits`` with a row for every draft token and the bonus. A chain cut after a token the grammar
    forbids scored no row past it: a copy of the last row stands there, never read (every rule rejects the
    forbidden token, its masked target probability being 0)."""
    missing = len(pending.draft) + 1 - logits.shape[0]
    return logits if missing <= 0 else torch.cat([logits, logits[-1:].expand(missing, -1)])


def autoregressive_generate(
    target: LoadedModel,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    on_text: TextCallback | None = None,
    runner: ModelRunner | None = None,
    logprobs: int | None = None,
) -> GenerationOutput:
    """Plain decoding, one target pass per token, through the same runner, sampling and stop handling.

    ``runner``: one of ``target``'s runners to reuse (emptied first), instead of a fresh one per call;
    ``logprobs``: as for ``SpeculativeDecoder.generate``."""
    target = load_model(target)
    params = SamplingParams() if params is None else params
    request = Request(target, prompt, params, on_text, logprobs)
    if runner is None:
        runner = target.new_runner()
    else:
        runner.reset()
    request.prefill(runner)
    while not request.done:
        t0 = time.perf_counter()
        logits = runner.forward(torch.tensor(request.context[-1:], dtype=torch.int64))
        token = request.noise.token(request.target_logits(logits)[0], params, len(request.context))
        request.stats.verify_seconds += time.perf_counter() - t0
        request.stats.record_round(0, 0)
        request.emit([token], round_sources(0, False, False), logits)
    return request.finish()
