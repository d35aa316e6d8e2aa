"""OpenAI's shapes: the request bodies of /v1/completions and /v1/chat/completions, responses, stream chunks,
and errors (``{"error": {"message", "type", "param", "code"}}``).

Bodies are parsed strictly (a string where a number belongs is an error, not a coercion); unknown fields are
ignored, as OpenAI's own server does. Fields we cannot honour (n > 1, echo, penalties) are refused with a 400
rather than silently ignored. ``logprobs`` (and chat's ``top_logprobs``) are the target's own log-softmax,
before temperature, top-k and top-p (``provenance``). Extensions: ``top_k``; ``speculative`` (``false``,
``true`` or ``{"proposer": ..., "gamma": ...}``); ``stream_options.continuous_usage_stats`` (usage in every
chunk, as vLLM); ``include_sources`` (top level or in ``stream_options``: each choice or chunk lists its tokens'
sources, ``tokens.sources_json``); ``usage`` also counts drafted and accepted tokens and, in the final usage,
what speculation did (``speculation``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine import GenerationOutput
from ..provenance import MAX_TOP_LOGPROBS
from .tokens import TokenRecord, chat_logprobs_json, completion_logprobs_json, sources_json

MAX_STOP_STRINGS = 4
MAX_GAMMA = 16
MAX_SEED = 2**63
SOURCES = "Each token's source (a draft guess accepted at its depth, or the target's own token) with its text."


class APIError(Exception):
    """An error the client gets as OpenAI's JSON shape with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` with OpenAI's error types by status."""
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line (and the offending field) from pydantic's errors: ``invalid max_tokens: ...``."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the body is not valid JSON ({detail})", None
    if not loc:
        return f"the body must be a JSON object: {first.get('msg')}", None
    param = loc[0]
    same = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == [param]]
    if len(same) > 1:  # a union: one message per alternative
        got = type(first.get("input")).__name__
        return f"invalid {param}: wrong type ({got})", param
    where = ".".join(loc)
    return f"invalid {where}: {first.get('msg')}", param


class ErrorDetail(BaseModel):
    message: str = Field(description="What is wrong and how to fix it.")
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error or server_error.")
    param: str | None = Field(description="The request field at fault, if one is.")
    code: str | None = Field(description="A machine-readable reason (e.g. invalid_api_key, model_not_found).")


class ErrorResponse(BaseModel):
    """OpenAI's error body: every error status carries it."""

    error: ErrorDetail


class DefaultSpeculation(BaseModel):
    proposer: str
    gamma: int | Literal["auto"]


class SpeculationState(BaseModel):
    """``GET /v1/speculation``: what the server offers and what its engine is doing now."""

    model: str = Field(description="The model id requests name.")
    proposers: list[str] = Field(description="What ``speculative.proposer`` may name (none = plain decoding).")
    default: DefaultSpeculation = Field(description="What a request without ``speculative`` gets.")
    max_gamma: int = Field(description="The most tokens one round drafts.")
    mode: Literal["reproducible", "exact"] = Field(description="The verification rule.")
    policy: Literal["auto", "always", "never"] = Field(description="When the engine speculates.")
    speculating: bool = Field(description="Whether the engine's last step drafted (with requests running).")
    running: int = Field(description="Requests being decoded.")
    waiting: int = Field(description="Requests waiting for a slot.")


def documented(default: Any = None, description: str | None = None, **schema: Any) -> Any:
    """A field whose JSON-schema keywords (``minimum``, ``minItems``, ...) state what ``check()`` refuses with its
    own message naming the field (pydantic does not enforce them: its wording would replace ours)."""
    return Field(default, description=description, json_schema_extra=schema or None)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class SpeculativeOptions(_Strict):
    """Per-request speculation: a proposer name and/or gamma (an integer or ``auto``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    proposer: str | None = Field(None, description="A name GET /v1/speculation lists (default: the server's).")
    gamma: int | Literal["auto"] | None = documented(
        description="The most tokens a round drafts, or auto.", minimum=1, maximum=MAX_GAMMA
    )


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="A last chunk with the usage (and no choices).")
    continuous_usage_stats: bool = Field(False, description="The usage so far in every chunk.")
    include_sources: bool = Field(False, description=SOURCES)


class _Sampling(_Strict):
    """Fields both routes share."""

    model: str | None = Field(None, description="The served model's id (another is a 404); default: it.")
    max_tokens: int | None = documented(minimum=1)
    temperature: float | None = documented(description="0 = greedy (default 1).", minimum=0)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = documented(description="0 or -1 = off.", minimum=-1)
    seed: int | None = documented(
        description="The same seed gives the same text.", minimum=0, exclusiveMaximum=MAX_SEED
    )
    stop: str | list[str] | None = documented(
        description=f"Up to {MAX_STOP_STRINGS} stop strings.",
        anyOf=[
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
            {"type": "null"},
        ],
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = documented(1, "One choice per request.", minimum=1, maximum=1)
    speculative: bool | SpeculativeOptions | None = Field(
        None, description="false: plain decoding; true or an object: speculate (default: the server's policy)."
    )
    include_sources: bool = Field(False, description=SOURCES)
    presence_penalty: float | None = documented(description="Not supported: 0 or absent.", minimum=0, maximum=0)
    frequency_penalty: float | None = documented(description="Not supported: 0 or absent.", minimum=0, maximum=0)
    logit_bias: dict[str, float] | None = documented(description="Not supported: empty or absent.", maxProperties=0)
    user: str | None = None

    def checked_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        return self.max_tokens

    def check(self) -> None:
        """Refuse values we cannot honour, each with a message naming the field."""
        if self.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {self.n}", "n")
        if self.temperature is not None and self.temperature < 0:
            raise APIError(400, f"temperature must be >= 0 (0 = greedy), got {self.temperature}", "temperature")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k is not None and self.top_k < -1:
            raise APIError(400, f"top_k must be >= 0 (0 or -1 = off), got {self.top_k}", "top_k")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            raise APIError(400, f"seed must be in [0, 2**63), got {self.seed}", "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (it would change the target's distribution)", name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", "stop")
        if isinstance(self.speculative, SpeculativeOptions):
            gamma = self.speculative.gamma
            if isinstance(gamma, int) and not 1 <= gamma <= MAX_GAMMA:
                raise APIError(
                    400, f"speculative.gamma must be in 1..{MAX_GAMMA} or 'auto', got {gamma}", "speculative"
                )

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def wants_sources(self) -> bool:
        """Each token's source in the choice (or every chunk): top-level or ``stream_options.include_sources``."""
        return self.include_sources or (self.stream_options is not None and self.stream_options.include_sources)

    def logprob_alternatives(self) -> int | None:
        """How many alternatives each token's logprobs list (None: no logprobs)."""
        return None


PROMPT_SCHEMAS = [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},  # token ids
]


def _prompt_required(schema: dict[str, Any]) -> None:
    """The schema requires ``prompt``; the model does not, so that a missing one gets ``prompt is required``."""
    schema["required"] = [*schema.get("required", []), "prompt"]
    schema["properties"]["prompt"].pop("default", None)


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: a string, token ids, or a one-element list of either."""

    model_config = ConfigDict(json_schema_extra=_prompt_required)
    prompt: Any = documented(
        description="A string or token ids (each below the vocabulary size), or a list of one of either.",
        anyOf=[*PROMPT_SCHEMAS, {"type": "array", "items": {"anyOf": PROMPT_SCHEMAS}, "minItems": 1, "maxItems": 1}],
    )
    echo: bool = documented(False, "Not supported: false.", enum=[False])
    logprobs: int | None = documented(
        description="Each token's logprob and this many most likely alternatives (the target's own log-softmax).",
        minimum=0,
        maximum=MAX_TOP_LOGPROBS,
    )
    best_of: int | None = documented(minimum=1, maximum=1)
    suffix: str | None = documented(description="Not supported: empty or absent.", maxLength=0)

    def check(self) -> None:
        super().check()
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}", "logprobs")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    def prompt_value(self) -> str | list[int]:
        """The one prompt: a non-empty string or a non-empty list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
            raise APIError(400, f"one prompt per request, got {len(prompt)}", "prompt")
        if prompt is None:
            raise APIError(400, "prompt is required", "prompt")
        raise APIError(400, "prompt must be a string or a list of token ids", "prompt")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def _top_logprobs_need_logprobs(schema: dict[str, Any]) -> None:
    """The schema says what ``check()`` refuses: ``top_logprobs`` (a number) without ``logprobs: true``."""
    schema["if"] = {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]}
    schema["then"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra=_top_logprobs_need_logprobs)
    messages: list[ChatMessage] = documented(..., minItems=1)
    max_completion_tokens: int | None = documented(description="Overrides max_tokens.", minimum=1)
    logprobs: bool | None = Field(
        None, description="Each token's logprob (the target's own log-softmax, before temperature, top-k, top-p)."
    )
    top_logprobs: int | None = documented(
        description="With logprobs: this many most likely alternatives per token.", minimum=0, maximum=MAX_TOP_LOGPROBS
    )
    tools: list[Any] | None = documented(description="Not supported: empty or absent.", maxItems=0)

    def checked_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise APIError(
                    400, f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}", "max_tokens"
                )
            return self.max_completion_tokens
        return super().checked_max_tokens()

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise APIError(400, "messages is empty: give at least one message", "messages")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(
                    400, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}", "top_logprobs"
                )
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def finish_reason(output: GenerationOutput) -> str:
    """OpenAI's words: ``stop`` (EOS or a stop string) or ``length`` (max_tokens)."""
    return "length" if output.finish_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, output: GenerationOutput | None = None) -> dict[str, Any]:
    """Token counts; with the final output also drafted/accepted (and OpenAI's predicted-output details)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if output is not None:
        stats = output.stats
        out["prompt_tokens_details"] = {"cached_tokens": output.cached_tokens}
        out["drafted_tokens"] = stats.drafted
        out["accepted_tokens"] = stats.accepted
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": stats.accepted,
            "rejected_prediction_tokens": stats.drafted - stats.accepted,
        }
        out["speculation"] = {
            "rounds": stats.rounds,
            "tokens_per_round": stats.tokens_per_round,
            "acceptance_by_depth": stats.per_position_rate,
            "draft_seconds": stats.draft_seconds,
            "verify_seconds": stats.verify_seconds,
            "total_seconds": stats.total_seconds,
        }
    return out


class Shape:
    """Responses and stream chunks of one request, in the shape of its route; with ``sources`` or
    ``logprobs`` (not None), each choice also carries its tokens' records (``tokens``)."""

    def __init__(
        self,
        chat: bool,
        model: str,
        prompt_tokens: int,
        sources: bool = False,
        logprobs: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.chat = chat
        self.seed = seed  # the request's seed, in every body and chunk (a run can be replayed)
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.sources = sources
        self.logprobs = logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offset = 0  # completions' logprobs: where the next chunk's tokens start in the answer

    @property
    def wants_tokens(self) -> bool:
        return self.sources or self.logprobs is not None

    def _extras(self, choice: dict[str, Any], records: list[TokenRecord] | None) -> dict[str, Any]:
        """Put the records' logprobs (in the route's shape) and sources into ``choice``."""
        if records is None:
            return choice
        if self.logprobs is not None:
            if self.chat:
                choice["logprobs"] = chat_logprobs_json(records)
            else:
                choice["logprobs"] = completion_logprobs_json(records, self._text_offset)
                self._text_offset += sum(len(r.text) for r in records)
        if self.sources:
            choice["sources"] = sources_json(records)
        return choice

    def _envelope(self, kind: str, choice: dict[str, Any], usage_: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if usage_ is not None:
            body["usage"] = usage_
        if self.seed is not None:
            body["seed"] = self.seed
        return body

    def response(self, output: GenerationOutput, records: list[TokenRecord] | None = None) -> dict[str, Any]:
        """The non-streaming body (``records``: every token's, when the request asked for them)."""
        reason = finish_reason(output)
        if self.chat:
            message = {"role": "assistant", "content": output.text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": output.text, "logprobs": None, "finish_reason": reason}
        body = self._envelope(
            "chat.completion" if self.chat else "text_completion",
            self._extras(choice, records),
            usage(self.prompt_tokens, len(output.token_ids), output),
        )
        body["seed"] = output.seed
        return body

    def chunk(
        self,
        text: str,
        reason: str | None = None,
        usage_: dict[str, Any] | None = None,
        role: bool = False,
        records: list[TokenRecord] | None = None,
    ) -> str:
        """One server-sent event: a text delta (chat: the first carries the role) with its tokens' ``records``,
        or the finish reason."""
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            )
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        choice = self._extras(choice, records)
        return sse(self._envelope("chat.completion.chunk" if self.chat else "text_completion", choice, usage_))

    def usage_chunk(self, output: GenerationOutput) -> str:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        body = self._envelope(
            "chat.completion.chunk" if self.chat else "text_completion",
            {},
            usage(self.prompt_tokens, len(output.token_ids), output),
        )
        body["choices"] = []
        return sse(body)


def sse(body: dict[str, Any] | str) -> str:
    """``data: <json>`` and a blank line (``[DONE]`` as is)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


DONE = sse("[DONE]")
