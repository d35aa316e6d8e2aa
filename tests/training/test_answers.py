"""make-data: the target's own answers, decoded by the serving engine in batches, are plain decoding's answers
(greedy and seeded sampling), written as chats that train-head reads; a stopped run resumes where it stopped."""

from __future__ import annotations

import json

import pytest
from helpers.models import LARGE_VOCAB, word_target
from helpers.tokenizers import CHAT_TEMPLATE, write_chats
from typer.testing import CliRunner

import specdecode as sd
import specdecode.cli as cli
from specdecode import factory
from specdecode.training import answers
from specdecode.training.answers import ANSWERS_FILE, AnswerSettings, make_answers
from specdecode.training.samples import read_samples
from specdecode.training.train import TrainSettings

QUESTIONS = [" ".join(f"w{(5 * i + j * j) % LARGE_VOCAB}" for j in range(3 + i % 4)) * 2 for i in range(10)]


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return word_target(chat_template=CHAT_TEMPLATE, backend="native")


@pytest.fixture
def chats(tmp_path):
    return write_chats(tmp_path / "chats.jsonl", QUESTIONS)


def _answers(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / ANSWERS_FILE).read_text().splitlines()]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_answers_are_plain_decodings_whatever_the_batch(target, chats, tmp_path, temperature):
    settings = AnswerSettings(prompts=str(chats), max_new_tokens=12, temperature=temperature, seed=5, batch=4)
    stats = make_answers(target, settings, tmp_path / "out")
    assert stats.answered == stats.prompts == len(QUESTIONS) and stats.failed == 0
    records = sorted(_answers(tmp_path / "out"), key=lambda r: r["index"])
    assert [r["index"] for r in records] == list(range(len(QUESTIONS)))
    for record in records:
        user, assistant = record["messages"]
        assert user == {"role": "user", "content": QUESTIONS[record["index"]]}
        plain = sd.autoregressive_generate(
            target, target.chat_prompt(user["content"]), settings.params(record["index"])
        )
        assert assistant == {"role": "assistant", "content": plain.text}
        assert record["tokens"] == len(plain.token_ids) and record["seed"] == 5 + record["index"]
    held, train, _ = read_samples(target, TrainSettings(data=str(tmp_path / "out"), held_out=2, max_length=48))
    assert len(held) + len(train) == len(QUESTIONS)  # train-head reads them as chats


def test_a_stopped_run_resumes_where_it_stopped(target, chats, tmp_path):
    out = tmp_path / "out"
    first = make_answers(target, AnswerSettings(prompts=str(chats), limit=4, max_new_tokens=8), out)
    assert first.answered == 4
    with open(out / ANSWERS_FILE, "a") as file:
        file.write('{"messages": [{"role": "user", "con')  # a line cut off by a kill
    again = make_answers(target, AnswerSettings(prompts=str(chats), max_new_tokens=8), out)
    assert again.already == 4 and again.answered == len(QUESTIONS) - 4
    indices = [r["index"] for r in _answers(out)]
    assert sorted(indices) == list(range(len(QUESTIONS))) and len(indices) == len(set(indices))


def test_too_long_prompts_and_spec_bench_questions_are_skipped(target, tmp_path):
    path = tmp_path / "chats.jsonl"
    long_question = " ".join(["w3"] * 1100)  # past the tiny model's window with the answer
    rows = [QUESTIONS[0], long_question, QUESTIONS[1]]
    turns = [[{"role": "user", "content": q}, {"role": "assistant", "content": "w2"}] for q in rows]
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in turns))
    bench = tmp_path / "question.jsonl"
    bench.write_text(json.dumps({"turns": [QUESTIONS[1]]}) + "\n")
    stats = make_answers(target, AnswerSettings(prompts=str(path), max_new_tokens=8, spec_bench=str(bench)), tmp_path)
    assert (stats.prompts, stats.excluded, stats.too_long, stats.answered) == (2, 1, 1, 1)


def test_make_data_command(target, chats, tmp_path, monkeypatch):
    monkeypatch.setattr(factory, "load", lambda name, *settings: target)
    args = ["make-data", "--prompts", str(chats), "--out", str(tmp_path / "d"), "--limit", "3", "--max-new-tokens", "6"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert "3 answers" in result.stdout and len(_answers(tmp_path / "d")) == 3
    again = CliRunner().invoke(cli.app, args)
    assert again.exit_code == 0 and "0 answers" in again.stdout and "3 there before" in again.stdout
    bad = CliRunner().invoke(cli.app, ["make-data", "--prompts", str(chats), "--out", str(tmp_path), "--batch", "0"])
    assert bad.exit_code == 1 and "batch" in bad.stderr and "Traceback" not in bad.output


def test_skip_leaves_out_the_prompts_after_the_held_out_ones(target, chats, tmp_path, monkeypatch):
    """--skip grows a dataset with new prompts only: the held-out ones stay, the indices are the whole list's, and
    a later run without --skip fills the gap."""
    monkeypatch.setattr(answers, "HELD_OUT", 2)
    out = tmp_path / "out"
    first = make_answers(target, AnswerSettings(prompts=str(chats), limit=5, skip=3, max_new_tokens=8), out)
    assert first.answered == 5
    assert sorted(r["index"] for r in _answers(out)) == [0, 1, 5, 6, 7]
    for record in _answers(out):
        assert record["messages"][0]["content"] == QUESTIONS[record["index"]]
    rest = make_answers(target, AnswerSettings(prompts=str(chats), max_new_tokens=8), out)
    assert rest.already == 5 and sorted(r["index"] for r in _answers(out)) == list(range(len(QUESTIONS)))
    with pytest.raises(ValueError, match="leaves none to answer"):
        make_answers(target, AnswerSettings(prompts=str(chats), skip=len(QUESTIONS)), tmp_path / "none")
    with pytest.raises(ValueError, match="skip"):
        AnswerSettings(skip=-1)


def test_a_file_of_questions_alone_is_answered_but_not_trained_on(target, tmp_path):
    """Chats of a user turn alone (what a user with questions writes) are make-data's prompts, numbered with the
    answered chats among them; train-head still reads only chats with an answer."""
    lines = [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS[:3]]
    lines.insert(1, {"messages": [{"role": "user", "content": QUESTIONS[3]}, {"role": "assistant", "content": "w1"}]})
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stats = make_answers(target, AnswerSettings(prompts=str(path), max_new_tokens=4), tmp_path / "out")
    assert stats.answered == 4
    asked = {r["index"]: r["messages"][0]["content"] for r in _answers(tmp_path / "out")}
    assert asked == {0: QUESTIONS[0], 1: QUESTIONS[3], 2: QUESTIONS[1], 3: QUESTIONS[2]}
    with pytest.raises(ValueError, match="usable sequences"):
        read_samples(target, TrainSettings(data=str(path), held_out=1, max_length=48))
