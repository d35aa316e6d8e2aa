"""A request's state, shared by both loops and the server's scheduler: its context, output sink, generator and
noise, stats, grammar state, and the per-row transform of the target's logits (warps, then the grammar's mask);
and what a finished request returns."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..control import AdaptiveGamma, HybridGamma
from ..models.loaded import LoadedModel
from ..models.runner import ModelRunner
from ..sampling.keyed_noise import KeyedNoise
from ..sampling.params import SamplingParams
from ..sampling.warps import RowContexts, target_logits
from ..structured import Constraint, mask_logits
from .output import OutputSink
from .provenance import MAX_TOP_LOGPROBS, TokenLogprob, TokenSource, token_logprobs
from .stats import DecodeStats

TextCallback = Callable[[str], None]


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
    cached_tokens: int = 0  # prompt tokens whose KV came from a reused prefix, not this request's prefill


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
        self.cached_tokens = 0
        self.constraint: Constraint | None = None
        if params.grammar is not None:
            self.constraint = Constraint(params.grammar, target.tokenizer, target.vocab_size, target.eos_token_ids)

    def prefill(self, runner: ModelRunner, cached: int = 0, cached_hidden: torch.Tensor | None = None) -> None:
        """Fill the cache with every prompt token but the last, which leads the first round.

        ``cached`` > 0: the runner already holds this prompt's first ``cached`` tokens (a reused prefix, at most
        every token but the last; ``cached_hidden``, their target features when the runner captures them):
        only the rest is prefilled. Bitwise the same cache as a full prefill on a runner whose prefill rows
        are its step rows (``exact_prefix_reuse``)."""
        t0 = time.perf_counter()
        if not 0 <= cached <= max(0, len(self.context) - 1):
            raise ValueError(f"cached {cached} outside 0..{len(self.context) - 1}")
        if cached:
            runner.rollback_to(cached)
            if runner.capture_hidden:
                self.target_hidden.append(cached_hidden[:cached])
        else:
            runner.reset()
        self.cached_tokens = cached
        if len(self.context) - 1 > cached:
            runner.prefill(torch.tensor(self.context[cached:-1], dtype=torch.int64))
            self.keep_hidden(runner, slice(None))
        self.stats.prefill_seconds += time.perf_counter() - t0

    def keep_hidden(self, runner: ModelRunner, rows: slice | list[int]) -> None:
        """Record the features of the last pass's ``rows`` (verified tokens) if the runner captures them."""
        if runner.capture_hidden:
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
        if self.params.penalised:  # else the logits as they are: no per-round work for a request without warps
            drafted = torch.zeros(0, dtype=torch.int64) if draft_tokens is None else draft_tokens
            logits = target_logits(
                logits, self.params, RowContexts(self.context, len(self.prompt_ids), drafted, parents)
            )
        return mask_logits(logits, allowed)

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
            self.cached_tokens,
        )
