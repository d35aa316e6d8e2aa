"""What a request's output must match: a JSON object, a JSON schema, a regex or a grammar (Lark or GBNF), compiled
by llguidance (docs/DECISIONS.md: measured against xgrammar, benchmarks/structured_output.py --mask-cost)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

INSTALL = "structured output needs llguidance: pip install 'specdecode[structured]'"
KINDS = ("json_object", "json_schema", "regex", "lark", "gbnf")
# Flexible JSON's whitespace between tokens, bounded so that a constrained model cannot spend its budget on blanks:
# room for a newline and indentation to depth 5 (4 spaces a level), as pretty-printed JSON has.
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"


def json_options(strict: bool, compact: bool) -> dict[str, Any]:
    """llguidance's JSON options: ``compact`` fixes the separators (``,`` and ``:``, no whitespace anywhere, as
    OpenAI's structured outputs return JSON), else bounded whitespace between tokens; ``strict``: unsupported schema
    keywords are errors, not ignored."""
    if compact:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": not strict}
    return {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE, "lenient": not strict}


def llguidance_module():
    """The llguidance module, or a ValueError naming the extra to install."""
    try:
        import llguidance
    except ImportError:
        raise ValueError(INSTALL) from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A structured-output constraint: ``kind`` (one of ``KINDS``) and its ``source`` text (a JSON schema as JSON
    text, a regex, a Lark or a GBNF grammar; "" for ``json_object``). ``strict``: a JSON schema's unsupported
    keywords are an error (OpenAI's ``strict: true``) rather than ignored; ``compact``: JSON without whitespace
    (``json_options``; False: bounded whitespace between tokens). Build with the class methods; the
    grammar is compiled once here, so a bad one fails at construction with a one-line ``ValueError``."""

    kind: str
    source: str = ""
    strict: bool = True
    compact: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"a grammar's source must be a string, got {type(self.source).__name__}")
        error = llguidance_module().LLMatcher.validate_grammar(self.compiled())
        if error:
            raise ValueError(f"invalid {self.kind.replace('_', ' ')}: {_one_line(error)}")

    @classmethod
    def json_object(cls, compact: bool = True) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object", compact=compact)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, strict: bool = True, compact: bool = True) -> Grammar:
        """A JSON value valid under ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema), strict, compact)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Text matching ``pattern`` in full (Rust ``regex`` syntax)."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Text derived from a Lark grammar's ``start`` rule (llguidance's Lark dialect)."""
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> Grammar:
        """Text derived from a GBNF grammar's ``root`` rule (llama.cpp's format)."""
        return cls("gbnf", grammar)

    def compiled(self) -> str:
        """The grammar in llguidance's own format (what an ``LLMatcher`` takes)."""
        ll = llguidance_module()
        if self.kind in ("json_object", "json_schema"):
            schema = self.source or '{"type": "object"}'
            options = json_options(self.strict, self.compact)
            return ll.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if self.kind == "regex":
            return ll.LLMatcher.grammar_from_regex(self.source)
        try:
            return ll.grammar_from(self.kind, self.source)
        except ValueError as error:
            raise ValueError(f"invalid {self.kind} grammar: {_one_line(str(error))}") from None


def _one_line(message: str) -> str:
    return " ".join(message.split())
