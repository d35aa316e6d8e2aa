"""``tools`` and ``tool_choice`` on /v1/chat/completions (OpenAI's shapes). The tools are rendered into the prompt by
the model's chat template (``LoadedModel.chat_ids(messages, tools)``); a template that renders them no differently has
no tool support (a 400). The answer is constrained by the grammar of the template's own call convention
(``tool_calls``: Hermes/Qwen ``<tool_call>`` blocks, Llama 3 JSON): ``"auto"`` free text or calls, ``"required"``
calls only, a named function one call of it — each call's arguments valid under its function's parameters — so the
grammar's mask is part of the target's law at every verified row, as for ``response_format``, and the calls are
returned as OpenAI ``tool_calls``. A template that renders tools in no known convention takes forced calls as bare
``{"name", "arguments"}`` JSON and refuses ``"auto"``. ``"none"`` renders no tools (plain text). The loop's next turn
goes back through the template: an assistant message's ``tool_calls`` (their ``arguments`` as mappings,
transformers' convention) and ``tool`` messages with their ``tool_call_id``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...structured import Grammar
from .tool_calls import BARE, CallParser, call_grammar, convention_of

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
    '"auto" (the default with tools; needs a template whose call convention the server parses: Hermes/Qwen '
    "<tool_call> or Llama 3 JSON): text or calls, each call constrained by its function's parameters once it opens; "
    '"required" or {"type": "function", "function": {"name"}}: the answer is calls only; "none": plain text, no tools '
    "rendered."
)
PARALLEL_HELP = "false: at most one call (default true: several, where the model's convention has them)."
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


class ToolError(ValueError):
    """A bad ``tools`` or ``tool_choice``: one line, and the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: the tools the template renders (None: none), the grammar of the answer
    (None: free text) and the parser of its calls (None: no calls)."""

    rendered: list[dict[str, Any]] | None
    grammar: Grammar | None
    parser: CallParser | None
    forced: bool = False


NO_TOOLS = ToolPlan(None, None, None)


def tool_plan(
    tools: list[Tool] | None,
    choice: ToolChoice | None,
    template: str | None,
    tokenizer: Any,
    parallel: bool = True,
    compact: bool = True,
) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` and say what to render, constrain and parse, in the call convention of
    the chat ``template``; a ``ToolError`` naming the field."""
    if not tools:
        if choice is None or choice == "none":
            return NO_TOOLS
        raise ToolError("tool_choice needs tools: send tools or remove tool_choice", "tool_choice")
    functions = [tool.function for tool in tools]
    names = [f.name for f in functions]
    for name in names:
        if not NAME.fullmatch(name):
            raise ToolError(f"tools: function name {name!r} must be 1-64 letters, digits, '_' or '-'", "tools")
    if len(set(names)) < len(names):
        raise ToolError(f"tools: function names must be unique, got {names}", "tools")
    for function in functions:  # every function's parameters must compile, whichever is called
        try:
            Grammar.json_schema(function.parameters or NO_ARGUMENTS, strict=bool(function.strict))
        except ValueError as exc:
            raise ToolError(f"tools: function {function.name!r} has a bad parameters schema: {exc}", "tools") from None
    if choice == "none":
        return NO_TOOLS
    rendered = [tool.model_dump(exclude_none=True) for tool in tools]
    if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
        message = f"tool_choice names function {choice.function.name!r}, not among the tools ({', '.join(names)})"
        raise ToolError(message, "tool_choice")
    convention = convention_of(template)
    auto = choice is None or choice == "auto"
    if convention is None:
        if auto:
            return ToolPlan(rendered, None, None)  # refused once the template is known to render the tools
        convention = BARE
    if not isinstance(choice, str) and choice is not None:
        functions = [f for f in functions if f.name == choice.function.name]
        parallel = False
    schemas = {f.name: f.parameters or NO_ARGUMENTS for f in functions}
    strict = any(f.strict for f in functions)
    grammar = call_grammar(convention, schemas, tokenizer, auto=auto, parallel=parallel, strict=strict, compact=compact)
    return ToolPlan(rendered, grammar, CallParser(convention), forced=not auto)


AUTO_REFUSED = (
    'tool_choice "auto" (the default with tools) needs the model\'s own tool-call convention, and this chat template '
    'uses neither known one (Hermes/Qwen <tool_call> blocks, Llama 3 JSON); send tool_choice "required", a named '
    'function, or "none"'
)
NO_TOOL_SUPPORT = (
    "tools are not supported by this model's chat template (rendering them does not change the prompt): remove them"
)
