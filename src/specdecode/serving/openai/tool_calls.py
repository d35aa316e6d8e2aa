"""A model's own tool-call convention: the grammar of its calls and the parser of its answers.

A chat template that renders tools also tells the model how to call them. Two conventions are known, chosen from the
template's text (``convention_of``):

- **hermes** (Qwen 2.5/3, Hermes and their fine-tunes): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n
  </tool_call>`` blocks, one a line for parallel calls, after optional text;
- **llama3_json** (Llama 3.1-3.3): the whole answer is one ``{"name": "f", "parameters": {...}}`` object.

A template that renders tools in neither convention gets **bare**: a forced call as ``{"name":"f","arguments":{...}}``
(``tool_choice: "auto"`` needs a known convention). ``call_grammar`` is the grammar (llguidance Lark) of an answer:
with ``"auto"`` free text or calls, and once a call opens, its name among the tools and its arguments valid under that
function's parameters — the grammar masks the target's logits at every verified row like any grammar, so the calls
are exact under speculation. ``CallParser.parse`` splits an answer (whole, or as streamed so far) into its content
and calls; the stream's deltas are the differences between successive parses (``CallStream``)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...structured import Grammar
from ...structured.grammar import json_options


@dataclass(frozen=True)
class Convention:
    """How one family writes a call: ``open`` (a marker, "" for none) before each call's JSON, whose text is
    ``head`` + name + ``middle`` + arguments + ``tail``, then ``close`` (a marker); parallel calls are joined by
    ``separator`` (None: one call only); ``text_first``: free text may come before the first call."""

    name: str
    open: str
    close: str
    head: str
    middle: str
    tail: str
    separator: str | None
    text_first: bool


HERMES = Convention("hermes", "<tool_call>", "</tool_call>", '\n{"name": "', '", "arguments": ', "}\n", "\n", True)
LLAMA3_JSON = Convention("llama3_json", "", "", '{"name": "', '", "parameters": ', "}", None, False)
BARE = Convention("bare", "", "", '{"name":"', '","arguments":', "}", None, False)


def convention_of(template: str | dict[str, str] | None) -> Convention | None:
    """The call convention a chat template (or a tokenizer's named templates) teaches (None: neither known one)."""
    if not template:
        return None
    if isinstance(template, dict):
        template = "\n".join(template.values())
    if "<tool_call>" in template:
        return HERMES
    if '"parameters": dictionary of argument name' in template:  # Llama 3.1-3.3's words for a custom tool's call
        return LLAMA3_JSON
    return None


def _marker(text: str, tokenizer: Any) -> str:
    """A marker in the grammar: its special token (``<[id]>``) where the tokenizer has one spelling it (text the
    model writes can then never open a call), else the quoted text."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token, piece in added.items():
        if str(piece) == text:
            return f"<[{int(token)}]>"
    return json.dumps(text)


def call_grammar(
    convention: Convention,
    functions: dict[str, dict[str, Any]],
    tokenizer: Any,
    *,
    auto: bool,
    parallel: bool,
    strict: bool,
    compact: bool,
) -> Grammar:
    """The grammar of an answer that calls ``functions`` (name → parameters schema) in ``convention``: with ``auto``
    free text (which never opens a call) or calls, else calls only; ``parallel``: one or more calls, else one; each
    call's arguments valid under its function's schema, JSON as ``compact`` says (``json_options``)."""
    options = json_options(strict, compact)
    rules = []
    for index, (name, schema) in enumerate(functions.items()):
        arguments = json.dumps({**schema, "x-guidance": options})
        literal = json.dumps(convention.head + name + convention.middle)
        rules.append(f"fn_{index}: {literal} %json {arguments} {json.dumps(convention.tail)}")
    lines = ["call: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
    opener = _marker(convention.open, tokenizer) if convention.open else ""
    closer = _marker(convention.close, tokenizer) if convention.close else ""
    block = f"{opener} call {closer}".strip()
    many = parallel and convention.separator is not None
    calls = f"{block} ({json.dumps(convention.separator)} {block})*" if many else block
    if not auto:
        lines.append(f"start: {calls}")
    elif convention.text_first:
        # text that never spells the opening marker, then the calls; a marker that is text needs a lazy head
        lines.append(f"PLAIN: /(?s:.*)/ & ~/(?s:.*){_regex_escape(convention.open)}(?s:.*)/")
        if opener.startswith("<["):
            lines.append(f"start: PLAIN | PLAIN {calls}")
        else:
            rest = calls.removeprefix(opener).strip()
            lines += ["start: PLAIN | head " + rest, f"head[lazy]: /(?s:.*)/ {opener}"]
    else:  # the answer is text (not starting with "{") or calls
        lines.append(r"PLAIN: /([^{](?s:.*))?/")
        lines.append(f"start: PLAIN | {calls}")
    return Grammar.lark("\n".join(lines + rules))


def _regex_escape(text: str) -> str:
    """``text`` matched literally inside a Lark ``/.../`` regex."""
    return re.escape(text).replace("/", "\\/")


@dataclass
class PartialCall:
    """A call as far as it has been written: its ``name`` once whole, its ``arguments`` text so far."""

    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    """An answer split into its ``content`` (text before the calls; None when there is none and calls follow) and
    its ``calls``."""

    content: str | None
    calls: list[PartialCall] = field(default_factory=list)


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at ``start`` ends (one past its closing bracket), None if not yet."""
    depth, quoted, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if quoted:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class CallParser:
    """Splits a model's answers in ``convention`` into content and calls."""

    def __init__(self, convention: Convention) -> None:
        self.convention = convention

    def _first_call(self, text: str) -> int | None:
        c = self.convention
        if not c.text_first:
            return 0 if text.startswith("{") else None
        found = text.find(c.open)
        return None if found < 0 else found

    def _settled(self, text: str) -> int:
        """How much of a text with no call yet is surely content: not a trailing prefix of the opening marker nor
        trailing whitespace (a call may follow, and text before a call loses its trailing whitespace)."""
        c = self.convention
        if not c.text_first:
            return len(text) if text else 0
        end = len(text)
        for size in range(min(len(c.open) - 1, len(text)), 0, -1):
            if c.open.startswith(text[-size:]):
                end -= size
                break
        return len(text[:end].rstrip())

    def parse(self, text: str, final: bool) -> Parsed:
        """The content and calls of ``text``: the whole answer (``final``), or its part so far, whose content and
        arguments the rest of the answer only extends."""
        c = self.convention
        start = self._first_call(text)
        if start is None:
            return Parsed(text if final else text[: self._settled(text)])
        parsed = Parsed(text[:start].rstrip() or None)
        pos = start
        opening = c.open + c.head
        while True:
            if not text.startswith(opening, pos):
                return parsed
            pos += len(opening)
            quote = text.find('"', pos)
            if quote < 0:
                return parsed
            call = PartialCall(text[pos:quote])
            parsed.calls.append(call)
            pos = quote
            if not text.startswith(c.middle, pos):
                return parsed
            pos += len(c.middle)
            end = _json_end(text, pos)
            call.arguments = text[pos : len(text) if end is None else end]
            if end is None:
                return parsed
            pos = end
            if not text.startswith(c.tail + c.close, pos):
                return parsed
            call.complete = True
            pos += len(c.tail + c.close)
            if c.separator is None or not text.startswith(c.separator + c.open, pos):
                return parsed
            pos += len(c.separator)

    def message(self, text: str, cut: bool) -> tuple[dict[str, Any], bool]:
        """The assistant message of a whole answer and whether it called tools: its calls as OpenAI ``tool_calls``
        (``arguments`` the JSON text the model wrote); an answer ``cut`` (max_tokens) inside a call is its text."""
        parsed = self.parse(text, final=True)
        if not parsed.calls or (cut and not all(call.complete for call in parsed.calls)):
            return {"role": "assistant", "content": text}, False
        calls = [new_call(call.name, call.arguments) for call in parsed.calls]
        return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, True


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry with a fresh id."""
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


class CallStream:
    """One streamed answer's deltas in OpenAI's shape: content as it is settled, each call's first delta with its
    ``index``, ``id``, ``type`` and ``function.name`` (``arguments`` ""), then ``function.arguments`` fragments as
    they are written."""

    def __init__(self, parser: CallParser) -> None:
        self.parser = parser
        self.text = ""
        self.content = 0  # characters of content sent
        self.ids: list[str] = []  # the calls announced
        self.arguments: list[int] = []  # characters of each call's arguments sent

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas ``text`` (the answer's next piece) settles; ``final``: the answer is whole."""
        self.text += text
        parsed = self.parser.parse(self.text, final)
        deltas = []
        content = parsed.content or ""
        if len(content) > self.content:
            deltas.append({"content": content[self.content :]})
            self.content = len(content)
        for index, call in enumerate(parsed.calls):
            if index == len(self.ids):
                entry = new_call(call.name, "")
                self.ids.append(entry["id"])
                self.arguments.append(0)
                deltas.append({"tool_calls": [{"index": index, **entry}]})
            if len(call.arguments) > self.arguments[index]:
                fragment = call.arguments[self.arguments[index] :]
                self.arguments[index] = len(call.arguments)
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
        return deltas
