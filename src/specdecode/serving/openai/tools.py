"""``tools`` and ``tool_choice`` on /v1/chat/completions (OpenAI's shapes). The tools are rendered into the prompt by
the model's chat template (``LoadedModel.chat_ids(messages, tools)``); a template that renders them no differently has
no tool support (a 400). A forced call (``tool_choice`` ``"required"`` or a named function) is constrained by the
grammar of ``{"name": <a function's name>, "arguments": <valid under that function's parameters>}`` (JSON schema
``anyOf`` over the functions, or the named one only), so the grammar's mask is part of the target's law at every
verified row, as for ``response_format``, and the answer is returned as OpenAI ``tool_calls``. ``"none"`` renders no
tools (plain text). ``"auto"`` (OpenAI's default with tools) is refused: telling a call from text means parsing the
model's own tool-call format, which is model-dependent. The loop's next turn goes back through the template: an
assistant message's ``tool_calls`` (their ``arguments`` as mappings, transformers' convention) and ``tool``
messages with their ``tool_call_id``."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...structured import Grammar

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class FunctionSpec(_Strict):
    name: str = Field(description="The function's name (unique among the tools).", min_length=1)
    description: str | None = Field(None, description="Rendered by the chat template.")
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema the call's arguments are valid under (absent: no arguments)."
    )
    strict: bool | None = Field(
        None, description="true: a schema keyword the grammar engine does not support is a 400 (as response_format)."
    )


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="The arguments as a JSON string (as tool_calls returned them).")


class ToolCall(_Strict):
    """A call of an earlier answer, sent back in an assistant message of the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


def template_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Earlier calls as chat templates take them (transformers: ``arguments`` a mapping, not a string); a
    ``ValueError`` if an ``arguments`` is not a JSON object."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ValueError(f"tool call {call.id!r}: arguments must be a JSON object (as a string)")
        function = {"name": call.function.name, "arguments": arguments}
        out.append({"id": call.id, "type": "function", "function": function})
    return out


TOOLS_HELP = (
    'Functions the model may call ([{"type": "function", "function": {"name", "description", "parameters"}}]), '
    "rendered by the model's chat template (a template without tool support is a 400)."
)
TOOL_CHOICE_HELP = (
    '"required" or {"type": "function", "function": {"name"}}: the answer is one call, constrained by the '
    'function\'s parameters schema, returned as tool_calls; "none": plain text, no tools rendered. "auto" (the '
    "default with tools) is refused: it needs a parser of the model's own tool-call format."
)


class ToolError(ValueError):
    """A bad ``tools`` or ``tool_choice``: one line, and the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: the tools the template renders (None: none) and the grammar of the forced
    call (None: free text)."""

    rendered: list[dict[str, Any]] | None
    grammar: Grammar | None
    auto: bool


def call_schema(function: FunctionSpec) -> dict[str, Any]:
    """The JSON schema of one call of ``function``: its name, and arguments valid under its parameters."""
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.parameters or NO_ARGUMENTS},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_plan(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` and say what to render and constrain; a ``ToolError`` naming the field."""
    if not tools:
        if choice is None or choice == "none":
            return ToolPlan(None, None, False)
        raise ToolError("tool_choice needs tools: send tools or remove tool_choice", "tool_choice")
    functions = [tool.function for tool in tools]
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise ToolError(f"tools: function names must be unique, got {names}", "tools")
    grammars = {}
    for function in functions:  # every function's parameters must compile, whichever is called
        try:
            grammars[function.name] = Grammar.json_schema(call_schema(function), strict=bool(function.strict))
        except ValueError as exc:
            raise ToolError(f"tools: function {function.name!r} has a bad parameters schema: {exc}", "tools") from None
    if choice == "none":
        return ToolPlan(None, None, False)
    rendered = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice is None or choice == "auto":
        return ToolPlan(rendered, None, True)
    if choice == "required":
        if len(functions) == 1:
            return ToolPlan(rendered, grammars[names[0]], False)
        schema = {"anyOf": [call_schema(f) for f in functions]}
        return ToolPlan(rendered, Grammar.json_schema(schema, strict=any(f.strict for f in functions)), False)
    if choice.function.name not in grammars:
        message = f"tool_choice names function {choice.function.name!r}, not among the tools ({', '.join(names)})"
        raise ToolError(message, "tool_choice")
    return ToolPlan(rendered, grammars[choice.function.name], False)


AUTO_REFUSED = (
    'tool_choice "auto" (the default with tools) is not supported: telling a tool call from text needs a parser of '
    'this model\'s own tool-call format; send tool_choice "required", a named function, or "none"'
)
NO_TOOL_SUPPORT = (
    "tools are not supported by this model's chat template (rendering them does not change the prompt): remove them"
)


def tool_call_message(text: str) -> dict[str, Any] | None:
    """The assistant message of a forced call whose text is ``{"name", "arguments"}`` (OpenAI's ``tool_calls``,
    ``content: null``, ``arguments`` a JSON string); None if the text is not a whole call (cut by max_tokens)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        return None
    function = {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
    tool_call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [tool_call]}
