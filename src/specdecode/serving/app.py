"""The FastAPI app: OpenAI-compatible routes over one ``Scheduler`` (the engine thread).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with ``"stream": true``),
``GET /v1/models``, ``GET /v1/speculation`` (what the server offers and is doing), ``GET /health``,
``GET /metrics`` (Prometheus), and the page at ``GET /`` (``static/``; the page and /health need no key).
Handlers validate and tokenize on the event loop, hand the request to the engine thread and await its events; a
client that goes away (mid-stream, or while waiting) is cancelled at the engine's next step, which frees its
slot and cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Request, SpeculativeDecoder
from ..models.loader import LoadedModel
from ..params import SamplingParams
from ..proposers import DraftModelProposer, HybridProposer, PromptLookupProposer, Proposer, SuffixProposer
from .hosts import HostCheck
from .metrics import ServerMetrics
from .policy import POLICIES, SpeculationPolicy
from .protocol import (
    DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    Shape,
    SpeculationState,
    SpeculativeOptions,
    error_body,
    finish_reason,
    sse,
    usage,
    validation_message,
)
from .scheduler import PLAIN, Event, Job, Scheduler, Speculation
from .stalls import StalledReaderCut
from .tokens import TokenTrack

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
OPEN_PATHS = ("/health", "/", "/favicon.ico")  # and /static/...: the page holds no data; its API calls need the key
DISCONNECT_POLL_SECONDS = 0.25
SUFFIX_SCOPES = ("global", "request")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the window
CHAT_DEFAULT_MAX_TOKENS = 1024  # for a model that states no context window
RESERVE_FIX = "lower --max-batch or --max-context"
SERVER_CONTEXT = 4096  # tokens per request by default (less where the model's window is shorter), as llama-server
# A refused request's body (401, 413) is read and dropped up to this much, within this time, before the answer:
# a client that reads only after sending all of it (Python's http.client) then gets the error, not a reset. Past
# either bound the connection is closed: reading more would spend the server's bandwidth on a refused request.
DRAIN_BYTES = 64 * 2**20
DRAIN_SECONDS = 10.0


@dataclass(frozen=True)
class ServerConfig:
    """What ``specdecode serve`` serves and how (picklable when ``target`` is a name: Ray ships it to replicas).

    ``proposer``: the default proposer (``lookup``, ``draft`` with ``draft`` = a model path, ``self:N`` or
    ``skip:SKIP.json``, ``eagle``, ``medusa``, ``suffix``, a hybrid ``MODEL+suffix`` / ``MODEL+lookup`` such as
    ``eagle+lookup``, or ``none``); requests may pick ``none``, ``lookup``, this one, or a name in
    ``proposers`` (extra factories).
    ``gamma``: the most tokens a round drafts (an integer or ``auto`` = up to ``max_gamma``); ``policy``:
    ``auto`` (speculate when the measured costs say it pays), ``always`` or ``never``; ``mode``: the verification
    rule, ``reproducible`` (default: a seed gives the same text whatever the batch or the policy does) or
    ``exact``. ``suffix_scope``: with the suffix proposer or a hybrid, ``global`` (one history of every request's prompt
    and answer, updated as requests end) or ``request`` (each request drafts from its own tokens and the
    ``suffix_cache`` corpus only); ``suffix_cache``: a history file loaded at start (global scope: saved back at
    shutdown).
    """

    target: str | LoadedModel = "smollm2"
    proposer: str = "lookup"
    draft: str | None = None
    gamma: int | str = "auto"
    max_gamma: int = 8
    policy: str = "auto"
    mode: str = "reproducible"
    max_batch: int = 16
    api_key: str | None = None
    max_body_bytes: int = 1_000_000
    served_model_name: str | None = None
    dtype: str = "auto"  # load_model's default: an HF folder's own dtype, float32 for a GGUF's dense path
    quantization: str = "auto"
    group_size: int = 32
    threads: int | None = None
    proposers: Mapping[str, Callable[[], Proposer]] = field(default_factory=dict)
    suffix_cache: str | None = None
    suffix_scope: str = "global"
    heads: str | None = None  # proposer medusa: a folder of trained heads (default: the shipped ones)
    max_context: int | None = None  # tokens per request, prompt and output (default: SERVER_CONTEXT or the window)
    host: str = "127.0.0.1"  # the address served: with allowed_hosts, the Host names answered (hosts.py)
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be >= 1 token, got {self.max_context}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.mode not in ("reproducible", "exact"):
            raise ValueError(f"mode must be reproducible or exact, got {self.mode!r}")
        if self.gamma != "auto" and (isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1):
            raise ValueError(f"gamma must be an integer >= 1 or 'auto', got {self.gamma!r}")
        if self.proposer == "draft" and not self.draft:
            raise ValueError("the draft proposer needs a draft model: a path, self:N or skip:SKIP.json")
        if self.suffix_scope not in SUFFIX_SCOPES:
            raise ValueError(f"suffix_scope must be one of {', '.join(SUFFIX_SCOPES)}, got {self.suffix_scope!r}")
        if self.suffix_cache is not None and not self.copies:
            raise ValueError("--suffix-cache applies to --proposer suffix or a hybrid (eagle+suffix)")
        if self.heads is not None and self.proposer.partition("+")[0] != "medusa":
            raise ValueError("--heads applies to --proposer medusa (or medusa+suffix)")

    @property
    def copies(self) -> bool:
        """Whether the proposer drafts from a suffix history (``suffix``, ``MODEL+suffix``)."""
        return self.proposer == "suffix" or self.proposer.endswith("+suffix")


def server_context(config: ServerConfig, window: int | None) -> int:
    """Tokens per request: ``max_context`` if set, else ``SERVER_CONTEXT`` or the model's window if shorter."""
    if config.max_context is not None:
        return config.max_context
    return SERVER_CONTEXT if window is None else min(window, SERVER_CONTEXT)


def reserve_memory(config: ServerConfig) -> int | None:
    """Refuse (one line) a config whose ``max_batch`` requests of its context do not fit the memory available: the
    target's weights (and a draft model's), each request's KV cache and the largest pass's scratch, from the GGUF
    files' metadata before any weight is read. Return the context (None: not a GGUF file, the model's window)."""
    from ..factory import parse_quantization
    from ..models.loader import planned_footprint
    from ..models.memory import check_fits

    quantization = parse_quantization(config.quantization)
    plan = planned_footprint(config.target, config.dtype, quantization, config.group_size)
    if plan is None:  # not a GGUF file: nothing to read the sizes from before loading
        return config.max_context
    found, window = plan
    context = server_context(config, window)
    drafted = config.draft if config.proposer.partition("+")[0] == "draft" else None
    draft = None if drafted is None or drafted.startswith(("self:", "skip:")) else planned_footprint(drafted)
    name = str(config.target) if draft is None else f"{config.target} with draft {drafted}"
    check_fits(name, found if draft is None else found + draft[0], context, config.max_batch, fix=RESERVE_FIX)
    return context


def capped_to_context(config: ServerConfig, loaded: LoadedModel) -> LoadedModel:
    """``loaded`` capped to the config's context (a copy: the caller's model keeps its own cap), after refusing (one
    line) a config whose ``max_batch`` requests' KV caches and scratch do not fit (its weights are in memory)."""
    from ..models.memory import check_fits, loaded_footprint

    context = server_context(config, loaded.context_window)
    if loaded.backend == "native":
        found = dataclasses.replace(loaded_footprint(loaded), mapped=0, repacked=0)
        check_fits(loaded.name, found, context, config.max_batch, fix=RESERVE_FIX)
    return loaded if loaded.max_context == context else dataclasses.replace(loaded, max_context=context)


def replicate(proposer: Proposer) -> Callable[[], Proposer]:
    """A factory of proposers like ``proposer``, each with its own state (draft KV cache, n-gram index).

    An unknown kind is shared: proposers resync to the context they are given, so sharing is correct (only
    slower, as each switch between requests re-feeds the draft)."""
    if isinstance(proposer, DraftModelProposer):
        return lambda: DraftModelProposer(proposer.model)
    if isinstance(proposer, PromptLookupProposer):
        return lambda: PromptLookupProposer(proposer.max_ngram, proposer.min_ngram, proposer.branches)
    if isinstance(proposer, SuffixProposer | HybridProposer):
        return proposer.fork  # one history for every request (request scope: the prototype does not remember)
    return lambda: proposer


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
            decoder, factories, SpeculationPolicy(config.policy), config.max_batch, config.max_gamma, self.metrics
        )
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

    def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[Request, Speculation, Shape]:
        """Validate and tokenize; every problem is an ``APIError`` naming the field."""
        body.check()
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                404,
                f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                "model",
                "model_not_found",
            )
        chat = isinstance(body, ChatCompletionRequest)
        ids = self._chat_ids(body) if chat else self._prompt_ids(body)
        max_tokens = self._max_tokens(body, len(ids), chat)
        temperature = 1.0 if body.temperature is None else body.temperature
        top_k = 0 if body.top_k in (None, -1) else body.top_k
        top_p = 1.0 if body.top_p is None else body.top_p
        logprobs = body.logprob_alternatives()
        try:
            params = SamplingParams(temperature, top_k, top_p, max_tokens, body.seed, body.stop_strings())
            request = Request(self.target, ids, params, None, logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        shape = Shape(chat, self.model_name, len(ids), body.wants_sources(), logprobs, request.seed)
        return request, self._speculation(body.speculative), shape

    def _prompt_ids(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt_value()
        try:
            ids = self.target.encode(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from None
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        return ids

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self.target.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model '{self.model_name}' has no chat template: use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template's own checks (e.g. roles it refuses)
            raise APIError(400, f"the chat template refused these messages: {exc}", "messages") from None
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        if not ids:
            raise APIError(400, "messages produced an empty prompt", "messages")
        return [int(t) for t in ids]

    def _max_tokens(self, body: CompletionRequest | ChatCompletionRequest, prompt_tokens: int, chat: bool) -> int:
        """max_tokens as asked (checked against the context window), else the route's default, clipped to it."""
        asked = body.checked_max_tokens()
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
                f"max_tokens is {asked} but the prompt ({prompt_tokens} tokens) leaves {room} of the model's "
                f"{window}-token context window: ask for at most {room}",
                "max_tokens",
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
        request, speculation, shape = self.prepare(body)
        inbox = Inbox(asyncio.get_running_loop())
        job = Job(request, speculation, inbox.put, shape.wants_tokens)
        self.scheduler.submit(job)
        try:
            event = await inbox.next(http)
            if event.kind == "error":
                return _error_response(500, f"generation failed: {event.error}")
            if body.stream:
                return StreamingResponse(
                    self._stream(job, inbox, event, shape, body),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            while event.kind == "text":
                event = await inbox.next(http)
            if event.kind == "error":
                return _error_response(500, f"generation failed: {event.error}")
            output = event.output
            records = None
            if shape.wants_tokens:
                track = TokenTrack(self.target.decode)
                track.add(output.token_ids, output.sources, output.logprobs)
                records = track.finish(output.text)
            return JSONResponse(shape.response(output, records))
        except (ClientGone, asyncio.CancelledError):
            self.scheduler.cancel(job)
            raise

    async def _stream(
        self, job: Job, inbox: Inbox, event: Event, shape: Shape, body: CompletionRequest | ChatCompletionRequest
    ) -> AsyncIterator[str]:
        options = body.stream_options
        continuous = options is not None and options.continuous_usage_stats
        track = TokenTrack(self.target.decode) if shape.wants_tokens else None
        sent = 0  # characters of text streamed so far
        finished = False
        try:
            if shape.chat:
                yield shape.chunk("", role=True, usage_=usage(shape.prompt_tokens, 0) if continuous else None)
            while True:
                if event.kind == "text":
                    sent += len(event.text)
                    records = None
                    if track is not None:  # the tokens whose text has been streamed
                        track.add(event.token_ids, event.sources, event.logprobs)
                        records = track.take(sent)
                    if event.text or records:
                        running = usage(shape.prompt_tokens, event.completion_tokens) if continuous else None
                        yield shape.chunk(event.text, usage_=running, records=records)
                elif event.kind == "done":
                    output = event.output
                    final = usage(shape.prompt_tokens, len(output.token_ids), output) if continuous else None
                    records = None if track is None else track.finish(output.text)
                    yield shape.chunk("", finish_reason(output), usage_=final, records=records)
                    if options is not None and options.include_usage:
                        yield shape.usage_chunk(output)
                    finished = True
                    yield DONE
                    return
                else:
                    finished = True
                    yield sse(error_body(500, f"generation failed: {event.error}"))
                    yield DONE
                    return
                event = await inbox.next()
        finally:
            if not finished:
                self.scheduler.cancel(job)


class ClientGone(Exception):
    """The HTTP client disconnected while its request was in the engine."""


class Inbox:
    """One job's events, handed from the engine thread to the event loop (nothing is lost on a timeout)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: deque[Event] = deque()
        self._ready = asyncio.Event()
        self._check_at = 0.0

    def put(self, event: Event) -> None:
        """Called by the engine thread."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: the server is gone
            self._loop.call_soon_threadsafe(self._push, event)

    def _push(self, event: Event) -> None:
        self._events.append(event)
        self._ready.set()

    async def next(self, http: HTTPRequest | None = None) -> Event:
        """The next event; with ``http``, raise ``ClientGone`` once the client has disconnected (checked at
        most every ``DISCONNECT_POLL_SECONDS``, also while events keep coming)."""
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


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


class Guard:
    """ASGI middleware: the API key (every route but /health) and the request-body size limit (413).

    The body is read here, before the app sees it (up to the limit: the app then reads it from memory). A refused
    request's body is read and dropped first (``_drain``), so that a client that sends its whole body before
    reading the answer (Python's ``http.client``) gets the error rather than a reset connection."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.expected is not None and path not in OPEN_PATHS and not path.startswith("/static/"):
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                await _refuse(401, message, "invalid_api_key", scope, receive, send, _drainable(headers))
                return
        limit = self.max_body_bytes
        too_large = (413, _too_large(limit), "request_too_large", scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _refuse(*too_large, _drainable(headers))
            return
        messages: list[dict] = []  # the body's messages, up to its end (or a disconnect)
        received, more = 0, True
        while more:
            messages.append(message := await receive())
            more = message["type"] == "http.request" and message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > limit:  # no Content-Length (a chunked body), or a body longer than it said
                await _refuse(*too_large, more)
                return
        replay = deque(messages)

        async def replayed() -> dict:
            return replay.popleft() if replay else await receive()

        await self.app(scope, replayed, send)


def _drainable(headers: dict[bytes, bytes]) -> bool:
    """Whether to read a refused request's unread body: not when the client waits for ``100 Continue`` (it sends
    nothing unless asked), nor when it says the body is longer than ``DRAIN_BYTES``."""
    length = headers.get(b"content-length", b"")
    return headers.get(b"expect", b"").lower() != b"100-continue" and not (
        length.isdigit() and int(length) > DRAIN_BYTES
    )


async def _refuse(
    status: int, message: str, code: str, scope: dict, receive: Callable, send: Callable, drain: bool
) -> None:
    """Answer ``status`` without running the app; with ``drain``, once the rest of the body has been read and
    dropped (``_drain``). Without it, or past the drain's bounds, the answer closes the connection."""
    response = _error_response(status, message, None, code)
    if not (drain and await _drain(receive)):
        response.headers["Connection"] = "close"
    await response(scope, receive, send)


async def _drain(receive: Callable) -> bool:
    """Read and drop the request body up to its end: True if it ended within ``DRAIN_BYTES`` and ``DRAIN_SECONDS``."""

    async def read() -> bool:
        dropped = 0
        while dropped <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return False  # the client went away
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    try:
        return await asyncio.wait_for(read(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        return False


ERROR_MEANINGS = {
    400: "A field the server cannot take or honour (``param`` names it).",
    401: "A missing or wrong API key (when the server has one).",
    404: "A model this server does not serve.",
    413: "A body larger than the server's limit (max_body_bytes).",
    500: "Generation failed.",
    "default": "Any other error (e.g. 405 for a wrong method, with an Allow header).",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses``: these statuses and any other error, each with OpenAI's error body."""
    return {s: {"model": ErrorResponse, "description": ERROR_MEANINGS[s]} for s in (*statuses, "default")}


GENERATION_RESPONSES = {
    200: {
        "description": "The answer; with ``stream``, server-sent events (``data: <chunk>``, last ``data: [DONE]``).",
        "content": {  # one event's schema, as FastAPI documents its own event streams
            "text/event-stream": {
                "itemSchema": {
                    "type": "object",
                    "properties": {"data": {"type": "string", "description": "A chunk as JSON, or [DONE]."}},
                    "required": ["data"],
                }
            }
        },
    },
    **_errors(400, 401, 404, 413, 500),
}


METRICS_RESPONSE = {
    "description": "Prometheus' text format.",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes"


def create_app(config: ServerConfig | Server) -> FastAPI:
    """The FastAPI app. Given a config, the model loads when the app starts (in each Ray replica)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server = config if isinstance(config, Server) else Server(config)
        server.scheduler.start()
        app.state.server = server
        try:
            yield
        finally:
            server.scheduler.stop()
            server.save_history()

    settings = config.config if isinstance(config, Server) else config
    app = FastAPI(title="specdecode", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return _error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        response = _error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # 405's Allow: the methods the route takes
        return response

    @app.exception_handler(Exception)
    async def server_error(_: HTTPRequest, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return _error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/health", responses={503: {"description": "The engine thread has stopped."}})
    async def health(request: HTTPRequest) -> JSONResponse:
        alive = request.app.state.server.scheduler.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/v1/models", responses=_errors(401))
    async def models(request: HTTPRequest) -> dict[str, Any]:
        server: Server = request.app.state.server
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "specdecode"}
        if server.window is not None:
            card["max_model_len"] = server.window
        return {"object": "list", "data": [card]}

    @app.get("/metrics", response_class=Response, responses={200: METRICS_RESPONSE, **_errors(401)})
    async def metrics(request: HTTPRequest) -> Response:
        return Response(request.app.state.server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/speculation", response_model=SpeculationState, responses=_errors(401))
    async def speculation(request: HTTPRequest) -> dict[str, Any]:
        """What the server offers (proposers, defaults) and what the engine is doing now."""
        return request.app.state.server.speculation_state()

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC, check_dir=False), name="static")

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await _answer(request, body)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        return await _answer(request, body)

    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(StalledReaderCut)  # a client that stops reading its stream is cut (stalls.py)
    app.add_middleware(HostCheck, bound=settings.host, allowed=settings.allowed_hosts)  # first: DNS rebinding
    return app


async def _answer(request: HTTPRequest, body: CompletionRequest | ChatCompletionRequest) -> Response:
    try:
        return await request.app.state.server.respond(body, request)
    except ClientGone:
        return Response(status_code=499)
