"""OpenAI's request shapes: the bodies of /v1/completions and /v1/chat/completions, and errors
(``{"error": {"message", "type", "param", "code"}}``); responses and stream chunks are ``responses``.

Bodies are parsed strictly (a string where a number belongs is an error, not a coercion). Nothing is silently
ignored: a field OpenAI defines that this server does not honour (``NOT_HONOURED``: ``audio``, ``functions``, ...) and
any unknown field get a 400 naming the field, and values we cannot honour (``echo``, ``best_of`` > 1) too.
Honoured: the sampling fields (``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``seed``, ``stop``), ``n`` up to ``MAX_CHOICES`` (choice i samples with its own seed,
``responses.choice_seed``), ``max_tokens`` / chat's ``max_completion_tokens``, ``stream_options.include_usage``,
``response_format`` (``text``, ``json_object``, ``json_schema``; extensions ``regex``, ``grammar``: ``structured``);
chat's ``tools`` with ``tool_choice`` ``"auto"``, ``"required"``, a named function or ``"none"`` and
``parallel_tool_calls`` (``tools``, ``tool_calls``);
``user`` is accepted and does not change the answer. ``logprobs`` (and chat's ``top_logprobs``) are the target's own
log-softmax, before any warp (``provenance``). Extensions: ``top_k``, ``min_p``, ``repetition_penalty`` (vLLM's
meanings; the warps' order and definitions: ``params.SamplingParams``, ``warps``); ``speculative`` (``false``,
``true`` or ``{"proposer": ..., "gamma": ...}``); ``stream_options.continuous_usage_stats`` (usage in every
chunk, as vLLM); ``json_whitespace`` (``compact``, the default, or ``flexible`` JSON); ``include_sources`` (top
level or in ``stream_options``: each choice or chunk lists its tokens' sources, ``tokens.sources_json``); ``usage``
also counts drafted and accepted tokens and, in the final usage, what speculation did (``speculation``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...engine.provenance import MAX_TOP_LOGPROBS
from .response_format import RESPONSE_FORMAT_HELP, ResponseFormat
from .tools import PARALLEL_HELP, TOOL_CHOICE_HELP, TOOLS_HELP, Tool, ToolCall, ToolChoice, template_tool_calls

MAX_STOP_STRINGS = 4
MAX_CHOICES = 8
MAX_LOGIT_BIAS = 300  # OpenAI's cap on logit_bias entries
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


# ---- OpenAI's fields this server does not honour -------------------------------------------------------------------
# Each is refused with a 400 naming it (a null is taken as absent), never ignored. THE place to edit when one is
# wired: remove it from here and add the field to the request models below.
NOT_HONOURED: dict[str, str] = {
    "functions": "functions are not supported: remove them",
    "function_call": "function_call is not supported: remove it",
    "audio": "audio output is not supported: remove it",
    "modalities": "modalities are not supported (text only): remove it",
    "prediction": "prediction (predicted outputs) is not supported: remove it (the server speculates on its own)",
    "web_search_options": "web search is not supported: remove web_search_options",
    "reasoning_effort": "reasoning_effort is not supported: remove it",
    "service_tier": "service_tier is not supported: remove it",
    "store": "store is not supported (nothing is stored): remove it",
    "metadata": "metadata is not supported (nothing is stored): remove it",
}


def unknown_field_message(loc: list[str]) -> str:
    """The 400's line for a field the request models do not take: an OpenAI field we do not honour, or unknown."""
    if len(loc) == 1 and loc[0] in NOT_HONOURED:
        return NOT_HONOURED[loc[0]]
    return f"unknown field {'.'.join(loc)}: this server does not take it (its fields: /openapi.json)"


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line (and the offending field) from pydantic's errors: ``invalid max_tokens: ...``."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "extra_forbidden" and loc:
        return unknown_field_message(loc), loc[0]
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
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


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

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """A field in ``NOT_HONOURED`` sent as null asks for nothing: drop it (any other value is refused)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in NOT_HONOURED and v is None)}
        return data

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
    n: int = documented(
        1,
        f"Choices (1..{MAX_CHOICES}); choice i samples with its own seed (choice_seed).",
        minimum=1,
        maximum=MAX_CHOICES,
    )
    speculative: bool | SpeculativeOptions | None = Field(
        None, description="false: plain decoding; true or an object: speculate (default: the server's policy)."
    )
    include_sources: bool = Field(False, description=SOURCES)
    presence_penalty: float | None = documented(
        description="Subtracted from the logit of every token generated so far (0 = off).", minimum=-2, maximum=2
    )
    frequency_penalty: float | None = documented(
        description="Times each token's count among the generated tokens, subtracted from its logit (0 = off).",
        minimum=-2,
        maximum=2,
    )
    repetition_penalty: float | None = documented(
        description="Extension (HF, vLLM): a token seen in the prompt or the output has a positive logit divided by "
        "it, a negative one multiplied (1 = off).",
        exclusiveMinimum=0,
    )
    min_p: float | None = documented(
        description="Extension (vLLM): drop tokens less likely than min_p times the most likely (0 = off).",
        minimum=0,
        maximum=1,
    )
    logit_bias: dict[str, float] | None = documented(
        description="Token id (as a string) to a value in [-100, 100] added to its logit before sampling.",
        maxProperties=MAX_LOGIT_BIAS,
        propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
    )
    user: str | None = Field(None, description="Accepted; it does not change the answer.")
    response_format: ResponseFormat | None = Field(None, description=RESPONSE_FORMAT_HELP)
    json_whitespace: Literal["compact", "flexible"] | None = Field(
        None,
        description="Extension: JSON under response_format and in tool arguments is compact (the default: no "
        "whitespace, as OpenAI returns it) or flexible (the model may put bounded whitespace between tokens).",
    )

    def checked_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        return self.max_tokens

    def check(self) -> None:
        """Refuse values we cannot honour, each with a message naming the field."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise APIError(400, f"n must be in 1..{MAX_CHOICES}, got {self.n}", "n")
        if self.temperature is not None and self.temperature < 0:
            raise APIError(400, f"temperature must be >= 0 (0 = greedy), got {self.temperature}", "temperature")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k is not None and self.top_k < -1:
            raise APIError(400, f"top_k must be >= 0 (0 or -1 = off), got {self.top_k}", "top_k")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            raise APIError(400, f"seed must be in [0, 2**63), got {self.seed}", "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2 <= value <= 2:
                raise APIError(400, f"{name} must be in [-2, 2] (0 = off), got {value}", name)
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise APIError(
                400, f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}", "repetition_penalty"
            )
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise APIError(400, f"min_p must be in [0, 1] (0 = off), got {self.min_p}", "min_p")
        self.token_bias()
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

    def token_bias(self) -> dict[int, float]:
        """``logit_bias`` with token ids as integers, each key and value checked."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()):
                raise APIError(400, f"logit_bias keys must be token ids (digits), got {key!r}", "logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for {key}", "logit_bias")
        return {int(key): value for key, value in bias.items()}

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


# Fields an assistant message carries back from an earlier answer (OpenAI's shape): as null they say nothing
MESSAGE_NULLABLE = ("refusal", "tool_calls", "function_call", "audio", "annotations")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: the calls an earlier answer made.")
    tool_call_id: str | None = Field(None, description="tool (required there): the call whose result this is.")

    @model_validator(mode="after")
    def _tool_fields_in_their_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (and only a tool message takes it)")
        if self.tool_calls is not None:
            template_tool_calls(self.tool_calls)
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (tool calls and the tool result's id included)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls is not None:
            message["tool_calls"] = template_tool_calls(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """A message echoed back from an answer may hold ``MESSAGE_NULLABLE`` fields as null: drop those (any other
        value is an unknown field, refused)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in MESSAGE_NULLABLE and v is None)}
        return data

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
    max_completion_tokens: int | None = documented(
        description="The most tokens each choice generates (OpenAI's successor of max_tokens; wins if both are set).",
        minimum=1,
    )
    logprobs: bool | None = Field(
        None, description="Each token's logprob (the target's own log-softmax, before temperature, top-k, top-p)."
    )
    top_logprobs: int | None = documented(
        description="With logprobs: this many most likely alternatives per token.", minimum=0, maximum=MAX_TOP_LOGPROBS
    )
    tools: list[Tool] | None = Field(None, description=TOOLS_HELP)
    tool_choice: ToolChoice | None = Field(None, description=TOOL_CHOICE_HELP)
    parallel_tool_calls: bool | None = Field(None, description=PARALLEL_HELP)

    def checked_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise APIError(
                    400,
                    f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                    "max_completion_tokens",
                )
            return self.max_completion_tokens
        return super().checked_max_tokens()

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise APIError(400, "messages is empty: give at least one message", "messages")
        called: set[str] = set()
        for message in self.messages:  # a tool result answers a call an earlier assistant message made
            called.update(call.id for call in message.tool_calls or ())
            if message.tool_call_id is not None and message.tool_call_id not in called:
                raise APIError(
                    400,
                    f"a tool message's tool_call_id {message.tool_call_id!r} matches no earlier assistant tool call",
                    "messages",
                )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(
                    400, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}", "top_logprobs"
                )

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
