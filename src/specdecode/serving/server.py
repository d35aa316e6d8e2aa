"""Request handling behind the routes: ``Server`` holds the loaded model and the engine thread, turns a body
into an engine request (validated and tokenized on the event loop), hands it to the engine thread and answers
from its events, whole or streamed; a client that goes away (mid-stream, or while waiting) is cancelled at the
engine's next step, which frees its slot and cache."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.decoder import SpeculativeDecoder
from ..engine.request import GenerationOutput, Request, fresh_seed
from ..models.loaded import LoadedModel
from ..proposers import HybridProposer, PromptLookupProposer, Proposer, SuffixProposer
from ..sampling.params import SamplingParams
from .batching.policy import SpeculationPolicy
from .batching.prefix_cache import build_prefix_cache
from .batching.scheduler import PLAIN, Event, Job, Scheduler, Speculation
from .config import ServerConfig, capped_to_context, replicate, reserve_memory
from .metrics import ServerMetrics
from .middleware import error_response
from .openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, SpeculativeOptions, error_body
from .openai.response_format import response_grammar
from .openai.responses import DONE, Shape, choice_seed, sse, usage
from .openai.tokens import TokenRecord, TokenTrack
from .openai.tools import AUTO_REFUSED, NO_TOOL_SUPPORT, NO_TOOLS, ToolError, ToolPlan, tool_plan

log = logging.getLogger(__name__)
DISCONNECT_POLL_SECONDS = 0.25
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the window
CHAT_DEFAULT_MAX_TOKENS = 1024  # for a model that states no context window


class Server:
    """The loaded model, the engine thread and the request handling behind the routes."""

    def __init__(self, config: ServerConfig) -> None:
        from ..factory import build_proposer, load, suffix_proposer

        if config.threads is not None:
            import torch

            torch.set_num_threads(config.threads)
        self.config = config
        if isinstance(config.target, LoadedModel):
            target = config.target
        else:
            context = reserve_memory(config)
            target = load(config.target, config.dtype, config.quantization, config.group_size, context)
        target = capped_to_context(config, target)
        self.target = target
        prototype = None
        remember = config.suffix_scope == "global"
        if config.proposer == "suffix":
            prototype = suffix_proposer(config.suffix_cache, remember=remember)
        elif config.proposer != PLAIN:
            prototype = build_proposer(
                config.proposer,
                target,
                config.draft,
                config.dtype,
                config.quantization,
                config.group_size,
                heads=config.heads,
                suffix_cache=config.suffix_cache,
                suffix_remember=remember,
            )
        self.suffix = prototype.copier if isinstance(prototype, HybridProposer) else prototype
        if not isinstance(self.suffix, SuffixProposer):
            self.suffix = None
        factories: dict[str, Callable[[], Proposer]] = {"lookup": PromptLookupProposer}
        if prototype is not None:
            factories[config.proposer] = replicate(prototype)
        factories.update(config.proposers)
        decoder = SpeculativeDecoder(
            target, prototype, gamma=config.gamma, max_gamma=config.max_gamma, mode=config.mode
        )
        self.default = Speculation(config.proposer, config.gamma)
        self.metrics = ServerMetrics()
        self.scheduler = Scheduler(
            decoder, factories, SpeculationPolicy(config.policy), config.max_batch, config.max_gamma, self.metrics,
            prefix_cache=build_prefix_cache(config.prefix_cache_gb, target, config.max_batch),
        )  # fmt: skip
        self.model_name = config.served_model_name or target.name
        self.window: int | None = target.context_window
        self.created = int(time.time())

    def save_history(self) -> None:
        """Global suffix scope with a cache file: write the history (every request's prompt and answer) back."""
        config = self.config
        if self.suffix is not None and config.suffix_cache is not None and config.suffix_scope == "global":
            try:
                self.suffix.save(config.suffix_cache)
            except OSError as error:  # a full disk (CacheFull's one line): the server still stops cleanly
                log.error("suffix history not saved: %s", error)
                return
            log.info("suffix history saved to %s (%d tokens)", config.suffix_cache, len(self.suffix.history))

    def speculation_state(self) -> dict[str, Any]:
        """``GET /v1/speculation``: the proposers a request may pick, the defaults, and whether the engine's last
        step speculated (with the running and waiting request counts)."""
        return {
            "model": self.model_name,
            "proposers": [PLAIN, *self.scheduler.proposers],
            "default": {"proposer": self.default.proposer, "gamma": self.default.gamma},
            "max_gamma": self.config.max_gamma,
            "mode": self.config.mode,
            "policy": self.config.policy,
            **self.scheduler.status(),
        }

    # --- turning a body into a job --------------------------------------------------------------------

    def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[list[Request], Speculation, Shape]:
        """Validate and tokenize; one engine request per choice (choice i seeded with ``choice_seed(seed, i)``);
        every problem is an ``APIError`` naming the field."""
        body.check()
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                404,
                f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                "model",
                "model_not_found",
            )
        chat = isinstance(body, ChatCompletionRequest)
        plan = self._tool_plan(body) if chat else NO_TOOLS
        ids = self._chat_ids(body, plan.rendered) if chat else self._prompt_ids(body)
        if plan.rendered is not None and plan.parser is None:  # after the template check: no tool support first
            raise APIError(400, AUTO_REFUSED, "tool_choice")
        max_tokens = self._max_tokens(body, len(ids), chat)
        temperature = 1.0 if body.temperature is None else body.temperature
        top_k = 0 if body.top_k in (None, -1) else body.top_k
        top_p = 1.0 if body.top_p is None else body.top_p
        logprobs = body.logprob_alternatives()
        bias = body.token_bias()
        if bias and max(bias) >= self.target.vocab_size:
            message = f"logit_bias names token {max(bias)}, past the vocabulary ({self.target.vocab_size} tokens)"
            raise APIError(400, message, "logit_bias")
        seed = fresh_seed() if body.seed is None else body.seed
        try:
            grammar = response_grammar(body.response_format, compact=body.json_whitespace != "flexible")
        except ValueError as exc:
            raise APIError(400, f"response_format: {exc}", "response_format") from None
        if plan.grammar is not None:
            if grammar is not None:
                message = "response_format and tool calls both constrain the output: send one of them"
                raise APIError(400, message, "response_format")
            grammar = plan.grammar
        warps = {
            "min_p": body.min_p or 0.0,
            "presence_penalty": body.presence_penalty or 0.0,
            "frequency_penalty": body.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
            "logit_bias": bias,
            "grammar": grammar,
        }
        requests = []
        try:
            for index in range(body.n):
                settings = (temperature, top_k, top_p, max_tokens, choice_seed(seed, index), body.stop_strings())
                params = SamplingParams(*settings, **warps)
                requests.append(Request(self.target, ids, params, None, logprobs))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        extras = (body.wants_sources(), logprobs, seed, body.n, plan.parser, plan.forced)
        shape = Shape(chat, self.model_name, len(ids), *extras)
        return requests, self._speculation(body.speculative), shape

    def _prompt_ids(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt_value()
        try:
            ids = self.target.encode(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        return ids

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        tokenizer = self.target.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        parallel = body.parallel_tool_calls is not False
        compact = body.json_whitespace != "flexible"
        try:
            return tool_plan(body.tools, body.tool_choice, template, tokenizer, parallel, compact)
        except ToolError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def _chat_ids(self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's ids through the chat template (``LoadedModel.chat_ids``; ``tools``: rendered by it, a 400 if
        the template renders them no differently)."""
        if not self.target.has_chat_template:
            raise APIError(400, f"model '{self.model_name}' has no chat template: use /v1/completions", "messages")
        messages = [m.template_dict() for m in body.messages]
        try:
            ids = self.target.chat_ids(messages, tools)
            if tools is not None and ids == self.target.chat_ids(messages):
                raise APIError(400, NO_TOOL_SUPPORT, "tools")
        except ValueError as exc:  # the template's own checks (e.g. roles it refuses)
            raise APIError(400, str(exc), "messages") from None
        if not ids:
            raise APIError(400, "messages produced an empty prompt", "messages")
        return [int(t) for t in ids]

    def _max_tokens(self, body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int, chat: bool) -> int:
        """max_tokens as asked (checked against the context window), else the route's default, clipped to it."""
        asked = body.checked_max_tokens()
        field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        window = self.window
        where = "messages" if chat else "prompt"
        if window is not None and prompt_tokens >= window:
            raise APIError(
                400,
                f"the prompt is {prompt_tokens} tokens; this model's context window is {window} tokens "
                "(prompt + max_tokens must fit): shorten the prompt",
                where,
                "context_length_exceeded",
            )
        room = None if window is None else window - prompt_tokens
        if asked is None:
            if chat:
                return CHAT_DEFAULT_MAX_TOKENS if room is None else room
            return COMPLETION_DEFAULT_MAX_TOKENS if room is None else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
        if room is not None and asked > room:
            raise APIError(
                400,
                f"{field} is {asked} but the prompt ({prompt_tokens} tokens) leaves {room} of the model's "
                f"{window}-token context window: ask for at most {room}",
                field,
                "context_length_exceeded",
            )
        return asked

    def _speculation(self, option: bool | SpeculativeOptions | None) -> Speculation:
        default = self.default
        fallback = default.proposer if default.proposer != PLAIN else "lookup"
        if option is None:
            return default
        if option is False:
            return Speculation(PLAIN, default.gamma)
        if option is True:
            return Speculation(fallback, default.gamma)
        proposer = option.proposer or fallback
        offered = [PLAIN, *self.scheduler.proposers]
        if proposer not in offered:
            raise APIError(
                400, f"unknown proposer {proposer!r}: this server offers {', '.join(offered)}", "speculative"
            )
        return Speculation(proposer, default.gamma if option.gamma is None else option.gamma)

    # --- answering ------------------------------------------------------------------------------------

    async def respond(self, body: CompletionRequest | ChatCompletionRequest, http: HTTPRequest) -> Response:
        requests, speculation, shape = self.prepare(body)
        inbox = Inbox(asyncio.get_running_loop())
        jobs = [
            Job(r, speculation, functools.partial(inbox.put, index=i), shape.wants_tokens)
            for i, r in enumerate(requests)
        ]
        for job in jobs:  # batched by the engine thread like any other requests
            self.scheduler.submit(job)
        try:
            first = await inbox.next(http)
            if first[1].kind == "error":
                self._cancel(jobs)
                return error_response(500, f"generation failed: {first[1].error}")
            if body.stream:
                return StreamingResponse(
                    self._stream(jobs, inbox, first, shape, body),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            outputs: list[GenerationOutput | None] = [None] * len(jobs)
            index, event = first
            while True:
                if event.kind == "error":
                    self._cancel(jobs)
                    return error_response(500, f"generation failed: {event.error}")
                if event.kind == "done":
                    outputs[index] = event.output
                    if all(output is not None for output in outputs):
                        break
                index, event = await inbox.next(http)
            records = [self._records(output) for output in outputs] if shape.wants_tokens else None
            return JSONResponse(shape.response(outputs, records))
        except (ClientGone, asyncio.CancelledError):
            self._cancel(jobs)
            raise

    def _records(self, output: GenerationOutput) -> list[TokenRecord]:
        track = TokenTrack(self.target.decode)
        track.add(output.token_ids, output.sources, output.logprobs)
        return track.finish(output.text)

    def _cancel(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.scheduler.cancel(job)

    async def _stream(
        self,
        jobs: list[Job],
        inbox: Inbox,
        first: tuple[int, Event],
        shape: Shape,
        body: CompletionRequest | ChatCompletionRequest,
    ) -> AsyncIterator[str]:
        """Every choice's chunks as its tokens come (each chunk names its choice's ``index``); after the last
        choice's finish, the usage chunk (``include_usage``) and ``[DONE]``."""
        options = body.stream_options
        continuous = options is not None and options.continuous_usage_stats
        n = len(jobs)
        tracks = [TokenTrack(self.target.decode) if shape.wants_tokens else None for _ in range(n)]
        sent = [0] * n  # characters of text streamed so far, per choice
        generated = [0] * n
        outputs: list[GenerationOutput | None] = [None] * n
        finished = False
        index, event = first
        try:
            if shape.chat:
                for choice in range(n):
                    opening = usage(shape.prompt_tokens, 0) if continuous else None
                    yield shape.chunk("", role=True, usage_=opening, index=choice)
            while True:
                track = tracks[index]
                if event.kind == "text":
                    sent[index] += len(event.text)
                    generated[index] = event.completion_tokens
                    records = None
                    if track is not None:  # the tokens whose text has been streamed
                        track.add(event.token_ids, event.sources, event.logprobs)
                        records = track.take(sent[index])
                    running = usage(shape.prompt_tokens, sum(generated)) if continuous else None
                    for line in shape.pieces(event.text, running, records, index):
                        yield line
                elif event.kind == "done":
                    output = outputs[index] = event.output
                    generated[index] = len(output.token_ids)
                    final = (
                        usage(shape.prompt_tokens, sum(generated), output.stats, output.cached_tokens)
                        if continuous
                        else None
                    )
                    records = None if track is None else track.finish(output.text)
                    for line in shape.finish(output, final, records, index):
                        yield line
                    if all(o is not None for o in outputs):
                        if options is not None and options.include_usage:
                            yield shape.usage_chunk(outputs)
                        finished = True
                        yield DONE
                        return
                else:
                    finished = True
                    self._cancel(jobs)
                    yield sse(error_body(500, f"generation failed: {event.error}"))
                    yield DONE
                    return
                index, event = await inbox.next()
        finally:
            if not finished:
                self._cancel(jobs)


class ClientGone(Exception):
    """The HTTP client disconnected while its request was in the engine."""


class Inbox:
    """A request's events (each tagged with its choice's index), handed from the engine thread to the event loop
    (nothing is lost on a timeout)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: deque[tuple[int, Event]] = deque()
        self._ready = asyncio.Event()
        self._check_at = 0.0

    def put(self, event: Event, index: int = 0) -> None:
        """Called by the engine thread: an event of choice ``index``."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: the server is gone
            self._loop.call_soon_threadsafe(self._push, (index, event))

    def _push(self, item: tuple[int, Event]) -> None:
        self._events.append(item)
        self._ready.set()

    async def next(self, http: HTTPRequest | None = None) -> tuple[int, Event]:
        """The next (choice index, event); with ``http``, raise ``ClientGone`` once the client has disconnected
        (checked at most every ``DISCONNECT_POLL_SECONDS``, also while events keep coming)."""
        while True:
            if http is not None and time.monotonic() >= self._check_at:
                self._check_at = time.monotonic() + DISCONNECT_POLL_SECONDS
                if await http.is_disconnected():
                    raise ClientGone
            if self._events:
                return self._events.popleft()
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), None if http is None else DISCONNECT_POLL_SECONDS)
