"""``response_format`` on both routes: OpenAI's shapes (``text``, ``json_object``, ``json_schema`` with ``strict``)
and two extensions (``regex``; ``grammar`` in Lark or GBNF), each turned into the ``structured.Grammar`` whose mask
is part of the target's distribution at every verified row (``specdecode.structured``). A schema or grammar the
engine cannot compile raises a one-line ``ValueError`` (the server's 400 naming ``response_format``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...structured import Grammar


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=True)


class TextFormat(_Strict):
    """Free text: no constraint (the default)."""

    type: Literal["text"]


class JsonObjectFormat(_Strict):
    """Any JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(description="The schema's name (OpenAI requires one; it does not change the answer).")
    description: str | None = Field(None, description="Accepted; it does not change the answer.")
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON schema the output must be valid under.")
    strict: bool | None = Field(
        None,
        description="true: a keyword the grammar engine does not support is a 400; false or absent (OpenAI's "
        "default): such keywords are ignored. Either way the output is constrained by every keyword supported.",
    )


class JsonSchemaFormat(_Strict):
    """JSON valid under ``json_schema.schema``."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(_Strict):
    """Extension: text matching ``regex`` in full (Rust regex syntax)."""

    type: Literal["regex"]
    regex: str


class GrammarFormat(_Strict):
    """Extension: text derived from ``grammar`` (Lark: its ``start`` rule; GBNF, llama.cpp's: its ``root`` rule)."""

    type: Literal["grammar"]
    syntax: Literal["lark", "gbnf"]
    grammar: str


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat, Field(discriminator="type")
]
RESPONSE_FORMAT_HELP = (
    'The output\'s form: {"type": "text"} (default), {"type": "json_object"}, {"type": "json_schema", '
    '"json_schema": {"name", "schema", "strict"}}; extensions {"type": "regex", "regex"} and {"type": "grammar", '
    '"syntax": "lark" | "gbnf", "grammar"}. Honoured exactly: the grammar masks the target at every verified row.'
)


def response_grammar(response_format: ResponseFormat | None, compact: bool = True) -> Grammar | None:
    """The grammar ``response_format`` asks for (None: free text; JSON ``compact`` or with bounded whitespace); a
    ``ValueError`` if it does not compile."""
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    if isinstance(response_format, JsonObjectFormat):
        return Grammar.json_object(compact)
    if isinstance(response_format, JsonSchemaFormat):
        spec = response_format.json_schema
        return Grammar.json_schema(spec.schema_, strict=bool(spec.strict), compact=compact)
    if isinstance(response_format, RegexFormat):
        return Grammar.regex(response_format.regex)
    if response_format.syntax == "lark":
        return Grammar.lark(response_format.grammar)
    return Grammar.gbnf(response_format.grammar)
