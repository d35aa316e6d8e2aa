"""``--json-schema FILE`` and ``--regex PATTERN``: the grammar a command's output must match
(``specdecode.structured``), each mistake refused in one line before the slow load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from specdecode.structured import Grammar

JsonSchemaOption = Annotated[
    str | None,
    typer.Option(
        metavar="FILE",
        help="Constrain the output to JSON valid under the JSON schema in FILE (strict, as OpenAI's strict: true: "
        "a keyword the grammar engine does not support is an error). Needs specdecode[structured].",
    ),
]
RegexOption = Annotated[
    str | None,
    typer.Option(metavar="PATTERN", help="Constrain the output to text matching PATTERN in full (Rust regex syntax)."),
]


def grammar_option(json_schema: str | None, regex: str | None) -> Grammar | None:
    """The grammar ``--json-schema`` (a file) or ``--regex`` names (None for neither): a missing or unreadable file,
    bad JSON, a bad schema or regex, or both options given, refused in one line naming the option."""
    if json_schema is None and regex is None:
        return None
    from specdecode.structured import Grammar

    if json_schema is not None and regex is not None:
        raise ValueError("--json-schema and --regex each constrain the whole output: give one of them")
    if regex is not None:
        try:
            return Grammar.regex(regex)
        except ValueError as error:
            raise ValueError(f"--regex: {error}") from None
    path = Path(json_schema).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--json-schema: no file {path}")
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--json-schema: {path} is not valid JSON ({error})") from None
    try:
        return Grammar.json_schema(schema)
    except ValueError as error:
        raise ValueError(f"--json-schema: {path}: {error}") from None
