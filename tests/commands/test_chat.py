"""`specdecode chat`: turns read line by line from standard input, each answer equal to generating from the
whole conversation afresh, the history's KV reused from turn 2 on."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

import specdecode as sd
import specdecode.cli as cli
from specdecode import factory

runner = CliRunner()
TURNS = ["w1 w2 w3 w1 w2", "w4 w5 w4", "w6"]


@pytest.fixture
def chat_target(monkeypatch):
    from helpers.models import word_target
    from helpers.tokenizers import CHAT_TEMPLATE

    loaded = word_target(seed=5, chat_template=CHAT_TEMPLATE)
    monkeypatch.setattr(factory, "load", lambda name, *settings: loaded)
    return loaded


def _expected(target, turns, max_new_tokens, system=None) -> list[str]:
    """Each turn's answer from a fresh plain decode of the whole conversation in the chat template."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    answers = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        params = sd.SamplingParams(max_new_tokens=max_new_tokens)
        answers.append(sd.autoregressive_generate(target, ids, params).text)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


@pytest.mark.parametrize("proposer", ["lookup", "none"])
def test_each_answer_is_the_whole_conversation_decoded_afresh_and_the_history_is_reused(chat_target, proposer):
    args = ["chat", "--max-new-tokens", "10", "--proposer", proposer, "--gamma", "3", "--system", "w9 w9"]
    result = runner.invoke(cli.app, args, input="\n".join(TURNS) + "\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == _expected(chat_target, TURNS, 10, system="w9 w9")
    reused = [int(n) for n in re.findall(r"(\d+) reused from the last turn", result.stderr)]
    assert len(reused) == 3 and reused[0] == 0 and all(n > 0 for n in reused[1:])
    assert result.stderr.count(f"proposer {proposer};") == 3


def test_reset_starts_over_and_exit_stops_reading(chat_target):
    script = f"{TURNS[0]}\n/reset\n\n{TURNS[0]}\n/exit\n{TURNS[1]}\n"
    result = runner.invoke(cli.app, ["chat", "--max-new-tokens", "6"], input=script)
    assert result.exit_code == 0, result.output
    first = _expected(chat_target, TURNS[:1], 6)
    assert result.stdout.splitlines() == first * 2  # the same first turn twice; nothing after /exit
    reused = [int(n) for n in re.findall(r"(\d+) reused from the last turn", result.stderr)]
    assert len(reused) == 2 and reused[1] > 0  # the repeated prompt is what the cache holds


def test_show_colours_the_answers(chat_target):
    result = runner.invoke(
        cli.app, ["chat", "--max-new-tokens", "8", "--show"], input=TURNS[0] + "\n",
        env={"FORCE_COLOR": "1", "TERM": "xterm-256color"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "\x1b[" in result.stdout
    assert re.sub(r"\x1b\[[0-9;]*m", "", result.stdout).splitlines() == _expected(chat_target, TURNS[:1], 8)
    assert "guessed and accepted at depth" in result.stderr


def test_a_bad_option_is_one_line(chat_target):
    result = runner.invoke(cli.app, ["chat", "--proposer", "draft"], input="w1\n")
    assert result.exit_code != 0 and "--draft" in result.output and "Traceback" not in result.output
