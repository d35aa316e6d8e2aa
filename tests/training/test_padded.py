"""make-data's padded batching (heads/padded.py): many prompts in one left-padded tensor, as a GPU answers."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.laws import chisquare_pvalue
from helpers.models import LARGE_VOCAB, word_target
from helpers.tokenizers import CHAT_TEMPLATE, write_chats
from typer.testing import CliRunner

import specdecode as sd
import specdecode.cli as cli
from specdecode.sampling.params import SamplingParams
from specdecode.sampling.probs import probs_from_logits
from specdecode.training import answers
from specdecode.training.answers import ANSWERS_FILE, AnswerSettings, make_answers, padded_batches
from specdecode.training.padded import answer_padded, left_pad

QUESTIONS = [" ".join(f"w{(7 * i + j * j) % LARGE_VOCAB}" for j in range(2 + i % 5)) for i in range(9)]
FALSE_ALARM = 1e-3


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return word_target(seed=11, eos="w3", chat_template=CHAT_TEMPLATE, backend="transformers")


@pytest.fixture
def chats(tmp_path):
    return write_chats(tmp_path / "chats.jsonl", QUESTIONS)


def test_left_pad_right_aligns_each_prompt():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_greedy_padded_answers_are_each_prompts_own_greedy_answer(target, chats, tmp_path):
    """Prompts of different lengths decoded together give, token for token, what each gives alone (float32 on
    the CPU: padding is masked and positions start at each prompt's first token), stopping at the EOS id."""
    settings = AnswerSettings(prompts=str(chats), max_new_tokens=10, batch=4, batching="padded", seed=2)
    stats = make_answers(target, settings, tmp_path / "out")
    assert stats.answered == len(QUESTIONS) and stats.failed == 0
    records = sorted(
        (json.loads(x) for x in (tmp_path / "out" / ANSWERS_FILE).read_text().splitlines()), key=lambda r: r["index"]
    )
    assert [r["index"] for r in records] == list(range(len(QUESTIONS)))
    reasons = set()
    for record in records:
        user, assistant = record["messages"]
        plain = sd.autoregressive_generate(target, target.chat_prompt(user["content"]), settings.params(0))
        assert assistant["content"] == plain.text and record["tokens"] == len(plain.token_ids)
        assert record["finish_reason"] == ("eos" if plain.token_ids[-1] == 3 else "length")
        reasons.add(record["finish_reason"])
    assert reasons == {"eos", "length"}  # rows stop at EOS while others go on
    again = make_answers(target, settings, tmp_path / "out")  # resumable as the engine's runs are
    assert again.already == len(QUESTIONS) and again.answered == 0


def test_sampled_padded_rows_draw_from_the_targets_law(target):
    """Every row of a sampled batch draws its first token from the target's warped law (chi-square against the
    law computed from the logits, false-alarm rate 1e-3), and a seed repeats the draws."""
    prompt = target.chat_prompt(QUESTIONS[4])
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=1, seed=7)
    rows = 3000
    first = [a.token_ids[0] for a in answer_padded(target.model, [prompt] * rows, params, frozenset({3}), LARGE_VOCAB)]
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt])).logits[0, -1]
    law = probs_from_logits(logits, params).double().numpy()
    counts = torch.bincount(torch.tensor(first), minlength=LARGE_VOCAB).numpy()
    assert chisquare_pvalue(counts, law) > FALSE_ALARM
    repeat = answer_padded(target.model, [prompt] * 50, params, frozenset({3}), LARGE_VOCAB)
    assert [a.token_ids for a in repeat] == [
        a.token_ids for a in answer_padded(target.model, [prompt] * 50, params, frozenset({3}), LARGE_VOCAB)
    ]


def test_padded_batches_take_prompts_in_windows_sorted_by_length_within_the_token_budget(monkeypatch):
    lengths = [5, 1, 9, 3, 7, 2, 8, 4, 6, 10]
    groups = padded_batches(lengths, batch=2, max_new_tokens=0)
    by_length = sorted(range(10), key=lambda i: lengths[i])  # one window of 8 batches of 2 holds all 10
    assert [i for g in groups for i in g] == by_length and [len(g) for g in groups] == [2] * 5
    windows = padded_batches(list(range(1, 21)), batch=1, max_new_tokens=0)
    assert [g[0] for g in windows[:8]] == list(range(8))  # the first window is the first 8 prompts
    monkeypatch.setattr(answers, "PADDED_TOKENS", 20)
    capped = padded_batches([6, 6, 6, 30], batch=8, max_new_tokens=4)
    assert capped == [[0, 1], [2], [3]]  # 2 rows x (6 + 4) fit 20; a lone prompt past it still gets a batch


def test_make_data_batching_option(target, chats, tmp_path, monkeypatch):
    monkeypatch.setattr("specdecode.models.loading.loader.load_model", lambda *a, **k: target)
    args = ["make-data", "--prompts", str(chats), "--out", str(tmp_path / "d"), "--limit", "3", "--max-new-tokens", "4"]
    result = CliRunner().invoke(cli.app, [*args, "--batching", "padded"])
    assert result.exit_code == 0, result.output
    assert "3 answers" in result.stdout
    bad = CliRunner().invoke(cli.app, [*args, "--batching", "sideways"])
    assert bad.exit_code == 1 and "--batching" in bad.stderr and "Traceback" not in bad.output
    with pytest.raises(ValueError, match="batching"):
        AnswerSettings(batching="sideways")


@pytest.mark.parametrize("batching", ["engine", "padded"])
def test_prompts_past_max_prompt_tokens_are_skipped_as_too_long(target, chats, tmp_path, batching):
    lengths = [len(target.chat_prompt(q)) for q in QUESTIONS]
    cap = sorted(lengths)[4]
    settings = AnswerSettings(prompts=str(chats), max_new_tokens=4, batching=batching, max_prompt_tokens=cap)
    stats = make_answers(target, settings, tmp_path / batching)
    kept = [i for i, n in enumerate(lengths) if n <= cap]
    assert stats.too_long == len(QUESTIONS) - len(kept) > 0 and stats.answered == len(kept)
    answered = sorted(json.loads(x)["index"] for x in (tmp_path / batching / ANSWERS_FILE).read_text().splitlines())
    assert answered == kept
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        AnswerSettings(max_prompt_tokens=0)


def test_finished_rows_leave_the_batch_and_the_others_answer_as_before(target):
    """A row that ends at an EOS id is dropped from the next forward (its KV rows with it) and the rows left
    go on exactly as a batch without that EOS id would (greedy, float32 on the CPU)."""
    prompts = [target.chat_prompt(q) for q in QUESTIONS[:4]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    free = answer_padded(target.model, prompts, params, frozenset(), LARGE_VOCAB)
    eos = free[0].token_ids[1]  # row 0 ends at its second token
    sizes: list[int] = []
    hook = target.model.register_forward_pre_hook(
        lambda _m, _a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        ended = answer_padded(target.model, prompts, params, frozenset({eos}), LARGE_VOCAB)
    finally:
        hook.remove()
    for alone, answer in zip(free, ended, strict=True):
        stop = alone.token_ids.index(eos) + 1 if eos in alone.token_ids else len(alone.token_ids)
        assert answer.token_ids == alone.token_ids[:stop]
        assert answer.finish_reason == ("eos" if eos in alone.token_ids else "length")
    expected = [sum(eos not in a.token_ids[:step] for a in free) for step in range(len(sizes))]
    assert sizes == expected and sizes[0] == 4 and sizes[-1] < 4


def test_bfloat16_padded_answers(target):
    """The target in bfloat16 (make-data --dtype bfloat16) answers a padded batch: every row its full length or
    ended at the EOS id, with ids inside the vocabulary."""
    model = copy.deepcopy(target.model).to(torch.bfloat16)
    prompts = [target.chat_prompt(q) for q in QUESTIONS[:5]]
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    for answer in answer_padded(model, prompts, params, frozenset({3}), LARGE_VOCAB):
        ids = answer.token_ids
        assert all(0 <= t < LARGE_VOCAB for t in ids)
        if 3 in ids:
            assert answer.finish_reason == "eos" and len(ids) == ids.index(3) + 1
        else:
            assert answer.finish_reason == "length" and len(ids) == 5


def test_make_data_dtype_option(target, chats, tmp_path, monkeypatch):
    seen: list[object] = []

    def load(*args, **kwargs):
        seen.append(kwargs.get("dtype"))
        return target

    monkeypatch.setattr("specdecode.models.loading.loader.load_model", load)
    args = ["make-data", "--prompts", str(chats), "--out", str(tmp_path / "d"), "--limit", "2", "--max-new-tokens", "3"]
    result = CliRunner().invoke(cli.app, [*args, "--batching", "padded", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert seen == ["bfloat16"]
    for extra, message in (
        (["--batching", "padded", "--dtype", "float64"], "--dtype"),
        (["--batching", "engine", "--dtype", "bfloat16"], "padded"),
    ):
        bad = CliRunner().invoke(cli.app, [*args, *extra])
        assert bad.exit_code == 1 and message in bad.stderr and "Traceback" not in bad.output
