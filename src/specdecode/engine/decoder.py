"""The speculative decoding loop and the plain autoregressive baseline, over the same runner and sampling."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..control import AcceptanceHistory, AdaptiveGamma, HybridGamma, PassCosts
from ..models.loaded import LoadedModel
from ..models.loading.loader import load_model
from ..models.runner import ModelRunner
from ..proposers.base import Proposer, as_proposer
from ..proposers.hybrid import HybridProposer
from ..proposers.prompt_lookup import PromptLookupProposer
from ..sampling.draft import EMPTY_DRAFT, Draft
from ..sampling.params import SamplingParams
from ..sampling.probs import probs_from_logits
from ..sampling.tree import attention_mask, children, depths, prune_depth
from ..sampling.verify import (
    coupled_verify,
    greedy_verify,
    speculative_sample,
    tree_coupled_verify,
    tree_greedy_verify,
    tree_speculative_sample,
)
from ..structured import Constraint
from .prefix_reuse import HeldPrefix, held_after, reusable_length
from .provenance import round_sources
from .request import GenerationOutput, Request, TextCallback
from .vocab import check_vocabularies

FORCED_PER_ROUND = 32  # tokens a grammar forces that one round drafts for free, at most


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

    def score(self, runner: ModelRunner) -> torch.Tensor:
        """The target's logits for the chunk: one pass of ``runner`` (a tree with its positions and mask)."""
        if self.positions is None:
            return runner.forward(self.tokens)
        return runner.forward(self.tokens, positions=self.positions, attn_mask=self.attn_mask)


class SpeculativeDecoder:
    """Draft up to ``gamma`` tokens, score them in one target pass, keep the longest acceptable run + 1.

    ``gamma="auto"`` (the default) chooses each round's draft length (≤ ``max_gamma``) from the acceptance and
    step costs measured so far, and 0 — a plain round — where speculation does not pay, probing with one guess
    at doubling intervals (``control``), so a proposer that is never right costs little over plain decoding.
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
    ``HybridProposer`` gets a controller a side (``HybridGamma``).
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
        self.costs = PassCosts()
        # gamma="auto": acceptance carried across requests, per drafter ("" the proposer, a hybrid's sides)
        self.acceptance_memories: dict[str, AcceptanceHistory] = {"": AcceptanceHistory()}
        self.last_output: GenerationOutput | None = None
        # What the runner holds after the last generate/stream: a prompt that extends it prefills only the rest.
        # Emptied while a request runs (an abandoned stream reuses nothing).
        self._held = HeldPrefix()
        self._target_runner: ModelRunner | None = None  # for generate/stream, allocated on first use
        self.use_proposer(PromptLookupProposer() if proposer is None else proposer)

    def use_proposer(self, proposer: Proposer | object) -> None:
        """Draft with ``proposer`` from the next request on, keeping what this decoder has measured (the target's
        costs, ``gamma="auto"``'s acceptance memory) and its runner, as a long-lived decoder does."""
        self.proposer = self.bind_proposer(proposer)
        if self._target_runner is not None:  # an EAGLE head reads the features it captures
            self._target_runner.capture_hidden = self.proposer.needs_target_hidden

    def forget_cache(self) -> None:
        """Reuse nothing the runner holds: the next request prefills its whole prompt (a cold start, as timed)."""
        self._held = HeldPrefix()

    def bind_proposer(self, proposer: Proposer | object) -> Proposer:
        """The entry point of a proposer: adapted if duck-typed (``as_proposer``), its draft model's vocabulary
        checked against the target's, given the target's vocabulary and the measured costs (``bind_target``)."""
        proposer = as_proposer(proposer)
        draft_model = proposer.vocabulary_model()
        if draft_model is not None:
            check_vocabularies(self.target, draft_model)
        proposer.bind_target(self.target.vocabulary_fingerprint, self.costs, self.target.vocab_size)
        return proposer

    def end_request(self, request: Request, proposer: Proposer | None) -> None:
        """Tell ``proposer`` (a suffix proposer remembers requests) that ``request`` ended."""
        if proposer is not None:
            proposer.end_request(request.context)

    @property
    def _runner(self) -> ModelRunner:
        """The target's runner for generate/stream, allocated on first use (the server brings its own)."""
        if self._target_runner is None:
            self._target_runner = self.target.new_runner()
            self._target_runner.capture_hidden = self.proposer.needs_target_hidden  # an EAGLE head reads them
        return self._target_runner

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
        self._held = held_after(request, self._runner)
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
        self._held = held_after(request, self._runner)
        self.last_output = request.finish()

    def _start(
        self, prompt: str | list[int], params: SamplingParams, on_text: TextCallback | None, logprobs: int | None
    ) -> Request:
        request = Request(self.target, prompt, params, on_text, logprobs)
        if self.gamma == "auto" and isinstance(self.proposer, HybridProposer):
            request.controller = HybridGamma.for_request(
                self.proposer, request.context, self.max_gamma, self.costs, self.acceptance_memories
            )
        elif self.gamma == "auto":
            request.controller = AdaptiveGamma(self.max_gamma, self.costs, self.acceptance_memories[""])
        self._prefill_reusing(request)
        return request

    def _prefill_reusing(self, request: Request) -> None:
        """Prefill ``request`` on this decoder's runner, keeping the entries of the longest prefix its context
        shares with what the runner holds from the last request (a chat's next turn): only the rest is
        prefilled, bitwise as a full prefill (``exact_prefix_reuse``; other runners always prefill in full).

        The proposers' own state is not handed over: a draft model's cache keeps its own longest common prefix
        (``DraftModelProposer``), an EAGLE head re-reads the target's features (the reused prefix's come from
        ``HeldPrefix``) and catches its one-layer cache up at its first draft, lookup and suffix proposers
        read the context."""
        held, self._held = self._held, HeldPrefix()
        request.prefill(self._runner, reusable_length(self._runner, held, request.context), held.hidden)

    def _round(self, request: Request) -> None:
        controller = request.controller
        k = min(self.gamma if controller is None else controller.choose(), request.sink.remaining - 1)
        this_round = self.draft(request, self.proposer, k)
        started = time.perf_counter()
        logits = this_round.score(self._runner)
        self.verify_round(request, this_round, logits, self._runner, started)

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
        if proposer is not None and proposer.needs_target_hidden:  # an EAGLE head: the features verified so far
            proposer.observe_target(request.target_hidden)
        if proposer is None:
            draft = EMPTY_DRAFT
        elif self.mode == "reproducible" and proposer.couples_with_keyed_noise:
            draft = proposer.propose_coupled(context, k, params, request.noise)
        else:
            draft = proposer.propose(context, k, params, request.generator)
        if draft.is_tree:  # a proposer must never push a round past gamma or the token budget
            draft = prune_depth(draft, k)
        if not draft.is_tree and len(draft) > k:
            draft = draft.truncated(k)
        draft, context = draft.after_forced(forced), request.context
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

    def verify_round(
        self, request: Request, this_round: Round, logits: torch.Tensor, runner: ModelRunner, started: float
    ) -> None:
        """Verify a round given the target's ``logits`` for its chunk (``runner`` scored it from time
        ``started``): record stats, emit the kept tokens, roll the runner's cache back to context − 1."""
        logits = every_row(this_round, logits)
        if this_round.positions is not None:
            self._verify_tree_round(request, this_round, logits, runner, started)
            return
        params, context, stats, controller = request.params, request.context, request.stats, request.controller
        draft = this_round.draft
        n_drafted = len(draft)
        warped = request.target_logits(logits, draft.tokens, allowed=this_round.allowed)
        if params.greedy:
            n_accepted, token = greedy_verify(warped, draft.tokens)
        elif self.mode == "reproducible":
            target_tokens = request.noise.tokens(warped, params, len(context))
            n_accepted, token = coupled_verify(target_tokens, draft.tokens)
        else:
            target_probs = probs_from_logits(warped, params)
            n_accepted, token = speculative_sample(target_probs, draft.probs, draft.tokens, request.generator)
        t2 = time.perf_counter()
        stats.draft_seconds += this_round.draft_seconds
        stats.verify_seconds += t2 - started
        guessed, kept = n_drafted - this_round.forced, n_accepted - this_round.forced  # forced: counted apart
        stats.forced += this_round.forced
        stats.record_round(guessed, kept)
        if controller is not None:
            controller.observe(guessed, kept)
            draft_price = None if controller.catching_up else this_round.draft_seconds
            self.costs.observe(len(this_round.tokens), t2 - started, guessed, draft_price, controller.drafter)
        request.keep_hidden(runner, slice(0, n_accepted + 1))  # the newest context token's row and the accepted
        sources = round_sources(n_accepted, n_drafted > 0, n_accepted < n_drafted)
        request.emit(draft.tokens[:n_accepted].tolist() + [token], sources, logits[: n_accepted + 1])
        runner.rollback_to(len(context) - 1)

    def _verify_tree_round(
        self, request: Request, this_round: Round, logits: torch.Tensor, runner: ModelRunner, started: float
    ) -> None:
        """``verify_round`` for a token tree: the mode's tree rule picks a root path; ``runner`` retains its entries."""
        params, context, stats, controller = request.params, request.context, request.stats, request.controller
        draft = this_round.draft
        warped = request.target_logits(logits, draft.tokens, draft.parents, this_round.allowed)
        if params.greedy:
            accepted, token = tree_greedy_verify(warped, draft.tokens, draft.parents)
        elif self.mode == "reproducible":
            target_tokens = request.noise.tokens_at(warped, params, (this_round.positions + 1).tolist())
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
        nodes_per_depth = torch.bincount(this_round.positions[1:] - this_round.positions[0])[1:].tolist()
        stats.draft_seconds += this_round.draft_seconds
        stats.verify_seconds += t2 - started
        stats.forced += this_round.forced  # the forced chain leads the tree: counted apart
        kept = len(accepted) - this_round.forced
        stats.record_tree_round(nodes_per_depth[this_round.forced :], kept, rejected, siblings)
        if controller is not None:
            controller.observe(kept + rejected, kept)
            controller.observe_tree(len(draft) + 1, this_round.draft_seconds)
            draft_price = None if controller.catching_up else this_round.draft_seconds
            self.costs.observe(len(draft) + 1, t2 - started, len(draft), draft_price, controller.drafter)
        start = len(context)  # node i sits at slot start + i
        path_rows = [0] + [node + 1 for node in accepted]  # the rows that chose the emitted tokens
        request.keep_hidden(runner, path_rows)
        sources = round_sources(len(accepted), True, rejected)
        chosen_by = logits[path_rows] if request.logprobs is not None else logits  # gather only when read
        request.emit(draft.tokens[accepted].tolist() + [token], sources, chosen_by)
        runner.retain(start, [start + node for node in accepted])


def every_row(this_round: Round, logits: torch.Tensor) -> torch.Tensor:
    """The target's ``logits`` with a row for every draft token and the bonus. A chain cut after a token the grammar
    forbids scored no row past it: a copy of the last row stands there, never read (every rule rejects the
    forbidden token, its masked target probability being 0)."""
    missing = len(this_round.draft) + 1 - logits.shape[0]
    return logits if missing <= 0 else torch.cat([logits, logits[-1:].expand(missing, -1)])


def cut_at_forbidden(constraint: Constraint, draft: Draft) -> tuple[Draft, torch.Tensor, int]:
    """(the chain ``draft`` cut after its first token the grammar forbids, the masks of its rows [len + 1, V], n):
    the target scores the n allowed tokens only; the forbidden one stays drafted, to be rejected with the residual
    of its own row (dropping it instead would bias the law whenever the draft has a distribution). The row past it,
    never reached, allows every token."""
    allowed, n = constraint.chain_masks(draft.tokens.tolist())
    if n == len(draft):
        return draft, allowed, n
    return draft.truncated(n + 1), torch.cat([allowed, torch.ones_like(allowed[:1])]), n


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
