"""make-data --prompts self: the target writes its own questions from its chat template's text before a user turn;
each kept question is the target's own sample (seed + i), the dropped samples break a stated rule, a stopped run
resumes to the same file, and make-data answers what was written."""

from __future__ import annotations

import json

import pytest
from helpers.models import word_target
from helpers.tokenizers import WORDS
from typer.testing import CliRunner

import specdecode as sd
import specdecode.cli as cli
from specdecode import factory
from specdecode.training.answers import ANSWERS_FILE, AnswerSettings, make_answers
from specdecode.training.data import normalise
from specdecode.training.questions import QUESTIONS_FILE, QuestionSettings, pre_query_ids, write_questions

EOS = 3
TEMPLATE = "{% for m in messages %}w1 w2 {{ m['content'] }} w3 {% endfor %}"


def _target(template: str | None = TEMPLATE) -> sd.LoadedModel:
    return word_target(seed=12, eos=WORDS[EOS], chat_template=template, backend="native")


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return _target()


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_pre_query_prefix_is_the_template_before_a_users_text(target):
    assert pre_query_ids(target) == [1, 2]
    with pytest.raises(ValueError, match="nothing before a user's text"):
        pre_query_ids(_target("{% for m in messages %}{{ m['content'] }} w3 {% endfor %}"))
    with pytest.raises(ValueError, match="no chat template"):
        pre_query_ids(_target(None))


def test_kept_questions_are_the_targets_samples_and_dropped_ones_break_a_rule(target, tmp_path):
    settings = QuestionSettings(count=6, max_new_tokens=12, min_words=2, max_words=8, seed=3)
    path = tmp_path / QUESTIONS_FILE
    stats = write_questions(target, settings, path)
    records = _lines(path)
    assert stats.kept == len(records) == 6 and stats.already == 0
    kept = {r["sample"]: r for r in records}
    assert stats.samples == max(kept) + 1  # the run stopped at its sixth kept question
    assert stats.samples == stats.kept + stats.unfinished + stats.wrong_length + stats.repeats + stats.excluded
    seen: set[str] = set()
    for sample in range(stats.samples):
        params = settings.params(sample)
        out = sd.autoregressive_generate(target, [1, 2], params)
        question = out.text.strip()
        usable = out.finish_reason == "eos" and 2 <= len(question.split()) <= 8 and normalise(question) not in seen
        assert usable == (sample in kept), (sample, question, out.finish_reason)
        if usable:
            assert kept[sample]["messages"] == [{"role": "user", "content": question}]
            assert kept[sample]["seed"] == params.seed
            seen.add(normalise(question))
    assert stats.unfinished + stats.wrong_length > 0  # the rules were exercised, not vacuous


def test_a_stopped_run_resumes_to_the_same_file(target, tmp_path):
    settings = QuestionSettings(count=6, max_new_tokens=12, min_words=2, max_words=8)
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    write_questions(target, settings, whole)
    write_questions(target, QuestionSettings(count=2, max_new_tokens=12, min_words=2, max_words=8), parts)
    with open(parts, "a") as file:  # a line the stop cut off
        file.write('{"messages": [{"role": "us')
    again = write_questions(target, settings, parts)
    assert again.already == 2 and again.kept == 4
    assert parts.read_text() == whole.read_text()
    assert write_questions(target, settings, parts).kept == 0  # complete: nothing more is written


def test_spec_bench_questions_are_never_kept(target, tmp_path):
    settings = QuestionSettings(count=4, max_new_tokens=12, min_words=2, max_words=8)
    write_questions(target, settings, tmp_path / "a.jsonl")
    banned = _lines(tmp_path / "a.jsonl")[1]["messages"][0]["content"]
    spec_bench = tmp_path / "question.jsonl"
    spec_bench.write_text(json.dumps({"question_id": 1, "turns": [banned.upper()]}) + "\n")
    excluding = QuestionSettings(count=4, max_new_tokens=12, min_words=2, max_words=8, spec_bench=str(spec_bench))
    stats = write_questions(target, excluding, tmp_path / "b.jsonl")
    written = [r["messages"][0]["content"] for r in _lines(tmp_path / "b.jsonl")]
    assert stats.excluded == 1 and banned not in written and len(written) == 4


def test_padded_batches_write_distinct_finished_questions(target, tmp_path):
    settings = QuestionSettings(count=5, max_new_tokens=12, min_words=2, max_words=8, batching="padded", batch=4)
    stats = write_questions(target, settings, tmp_path / "q.jsonl")
    records = _lines(tmp_path / "q.jsonl")
    assert stats.kept == len(records) == 5
    assert stats.samples == stats.kept + stats.unfinished + stats.wrong_length + stats.repeats + stats.excluded
    assert len({normalise(r["messages"][0]["content"]) for r in records}) == 5
    # a batch's rows share the seed of its first sample: the first batch is samples 0-3
    assert all(r["seed"] == settings.seed for r in records if r["sample"] < 4)
    assert all(settings.seed <= r["seed"] <= settings.seed + r["sample"] for r in records)


def test_settings_are_checked():
    for bad in ({"count": 0}, {"count": 2, "temperature": 0.0}, {"count": 2, "min_words": 9, "max_words": 8}):
        with pytest.raises(ValueError):
            QuestionSettings(**bad)
    with pytest.raises(ValueError, match="needs a limit"):
        AnswerSettings(prompts="self")


def test_a_target_that_never_finishes_a_question_stops_with_an_error(target, tmp_path):
    with pytest.raises(ValueError, match="usable questions"):
        write_questions(target, QuestionSettings(count=1, max_new_tokens=1, min_words=2), tmp_path / "q.jsonl")


def test_make_data_writes_then_answers_the_targets_questions(target, tmp_path, monkeypatch):
    monkeypatch.setattr(factory, "load", lambda name, *settings: target)
    out = tmp_path / "d"
    args = ["make-data", "--prompts", "self", "--out", str(out), "--limit", "4", "--max-new-tokens", "6"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    questions = [r["messages"][0]["content"] for r in _lines(out / QUESTIONS_FILE)]
    answers = sorted(_lines(out / ANSWERS_FILE), key=lambda r: r["index"])
    assert len(questions) == 4 and [r["messages"][0]["content"] for r in answers] == questions
    assert "4 questions in" in result.stderr and "4 answers" in result.stdout
    again = CliRunner().invoke(cli.app, args)
    assert again.exit_code == 0 and "0 answers" in again.stdout and "4 there before" in again.stdout
    bad = CliRunner().invoke(cli.app, ["make-data", "--prompts", "self", "--out", str(tmp_path / "e")])
    assert bad.exit_code == 1 and "needs a limit" in bad.stderr and "Traceback" not in bad.output
    # the library call does the same in one step
    stats = make_answers(target, AnswerSettings(prompts="self", limit=3, max_new_tokens=6), tmp_path / "f")
    assert stats.answered == 3 and len(_lines(tmp_path / "f" / QUESTIONS_FILE)) == 3
