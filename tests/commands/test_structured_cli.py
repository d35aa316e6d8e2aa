"""``specdecode generate --json-schema FILE`` and ``--regex``: output valid under the grammar, speculative equal to
plain, and one line (no traceback) for each mistake: a missing file, bad JSON, a bad schema or regex, both given."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.models import tiny_llama, with_eos
from helpers.structured import PIECES, SCHEMAS, json_tokenizer
from typer.testing import CliRunner

import specdecode as sd
import specdecode.cli as cli
from specdecode import factory

runner = CliRunner()
PROMPT = "{ [ a"


@pytest.fixture
def json_target(monkeypatch) -> sd.LoadedModel:
    """Every model name loads the tiny model over JSON pieces (tests/structured/test_structured.py)."""
    loaded = with_eos(sd.load_model(tiny_llama(len(PIECES), seed=0), tokenizer=json_tokenizer()), 0)
    monkeypatch.setattr(factory, "load", lambda name, *settings: loaded)
    return loaded


def generated(*options: str) -> dict:
    result = runner.invoke(cli.app, ["generate", PROMPT, "--raw", "--json", "--max-new-tokens", "60", *options])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("index", [5, 6, 8])
def test_json_schema_file_constrains_the_output(json_target, tmp_path, index):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMAS[index]))
    speculative = generated("--json-schema", str(path), "--temperature", "1", "--seed", "3")
    plain = generated("--json-schema", str(path), "--temperature", "1", "--seed", "3", "--proposer", "none")
    assert speculative["finish_reason"] == "eos"
    jsonschema.validate(json.loads(speculative["text"]), SCHEMAS[index])
    assert speculative["stats"]["forced"] > 0
    greedy = [generated("--json-schema", str(path), "--proposer", name)["token_ids"] for name in ("lookup", "none")]
    assert greedy[0] == greedy[1]
    assert plain["finish_reason"] == "eos"


def test_regex_constrains_the_output(json_target):
    out = generated("--regex", "(ab|ba){2,3}")
    assert out["text"] in {a + b + c for a in ("ab", "ba") for b in ("ab", "ba") for c in ("", "ab", "ba")}


@pytest.mark.parametrize(
    ("content", "options", "message"),
    [
        (None, ["--json-schema", "{missing}"], "--json-schema: no file"),
        ("{not json", ["--json-schema", "{file}"], "is not valid JSON"),
        ('{"type": "string", "format": "no-such-format"}', ["--json-schema", "{file}"], "--json-schema"),
        ('["a list"]', ["--json-schema", "{file}"], "must be a JSON object"),
        (None, ["--regex", "a(b"], "--regex"),
        ('{"type": "object"}', ["--json-schema", "{file}", "--regex", "a"], "give one of them"),
    ],
)
def test_grammar_mistakes_give_one_line(json_target, tmp_path, content, options, message):
    file = tmp_path / "schema.json"
    if content is not None:
        file.write_text(content)
    args = [o.format(file=file, missing=tmp_path / "missing.json") for o in options]
    result = runner.invoke(cli.app, ["generate", PROMPT, "--raw", *args])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
