"""Answer rows: the training rows whose guess is an assistant's token (heads/answer_rows.py) and the loss and the
held-out figures restricted to them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.models import tiny_llama
from helpers.tokenizers import CHAT_TEMPLATE, word_tokenizer

import specdecode as sd
from specdecode.training.answer_rows import AnswerMarkers, answer_markers, answer_positions, answer_rows
from specdecode.training.samples import read_samples
from specdecode.training.train import TrainSettings, head_loss, packed_answer_rows, train_head
from specdecode.training.windows import token_windows

WORDS = [f"w{i}" for i in range(60)] + ["<turn>", "user", "assistant", "<end>"]
TURN, USER, ASSISTANT, END = 60, 61, 62, 63
# ChatML's shape in words: "<turn> role\n content <end>\n", the generation prompt "<turn> assistant"
TEMPLATE = (
    "{% for m in messages %}<turn> {{ m['role'] }} {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<turn> assistant {% endif %}"
)


def with_tokenizer(tokenizer) -> sd.LoadedModel:
    return sd.load_model(tiny_llama(64, seed=3), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def chat_target() -> sd.LoadedModel:
    tokenizer = word_tokenizer(WORDS, eos="<end>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.add_special_tokens({"additional_special_tokens": ["<turn>"]})  # as <|im_start|> is
    assert len(tokenizer) == len(WORDS)
    return sd.load_model(tiny_llama(64, seed=3), tokenizer=tokenizer)


def test_markers_are_read_off_the_chat_template(chat_target):
    assert answer_markers(chat_target) == AnswerMarkers((TURN, ASSISTANT), END, frozenset({TURN, END}))
    plain = word_tokenizer(WORDS, eos="<end>")
    assert answer_markers(with_tokenizer(plain)) is None  # no template: every row counts
    odd = word_tokenizer(WORDS, eos="<end>")
    odd.chat_template = CHAT_TEMPLATE  # no generation prompt
    assert answer_markers(with_tokenizer(odd)) is None


def test_a_turn_end_marked_special_but_not_named_is_found():
    """transformers 5.17 converts smollm2's GGUF tokenizer with <|im_start|> as its EOS token: <|im_end|> is an
    added special token but not among the named ones. The end is still found."""
    tokenizer = word_tokenizer(WORDS, eos="<turn>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.add_special_tokens({"additional_special_tokens": ["<turn>"]})
    tokenizer.add_tokens(["<end>"], special_tokens=True)
    assert END not in tokenizer.all_special_ids and len(tokenizer) == len(WORDS)
    assert answer_markers(with_tokenizer(tokenizer)) == AnswerMarkers((TURN, ASSISTANT), END, frozenset({TURN, END}))


def test_answer_positions_cover_each_assistant_turn_and_its_end():
    markers = AnswerMarkers((TURN, ASSISTANT), END, frozenset({TURN, END}))
    ids = [TURN, USER, 5, 6, END, TURN, ASSISTANT, 7, 8, END, TURN, USER, 9, END, TURN, ASSISTANT, 10, 11]
    inside = answer_positions(ids, markers).tolist()
    expected = [False] * 7 + [True, True, True] + [False] * 6 + [True, True]  # the last turn runs to the cut
    assert inside == expected
    # a chat cut off inside its prompt has no answer rows; a plain text (no header, no end) is all answer rows
    assert not answer_positions([TURN, USER, 5, 6, 7], markers).any()
    assert not answer_positions([5, 6, END, TURN, USER, 7], markers).any()
    assert answer_positions([5, 6, 7, 8], markers).all()
    assert answer_positions(ids, None).all()
    assert answer_positions([], markers).numel() == 0


def test_row_t_counts_when_the_token_it_guesses_at_t_plus_2_is_an_answer_token():
    markers = AnswerMarkers((TURN, ASSISTANT), END)
    ids = [TURN, USER, 5, END, TURN, ASSISTANT, 7, 8, END, 3]
    inside = answer_positions(ids, markers)
    rows = answer_rows(ids, markers)
    assert rows.shape == inside.shape
    assert rows[:-2].tolist() == inside[2:].tolist()
    assert rows[-2:].tolist() == [inside[-1].item()] * 2  # past the text: as its last position
    assert answer_rows([5], markers).tolist() == [True]
    tokens = torch.tensor(ids + [5, 6, 7])
    positions = torch.tensor(list(range(len(ids))) + [0, 1, 2])
    packed = packed_answer_rows(tokens, positions, markers)
    assert packed.tolist() == rows.tolist() + [True, True, True]


def words(generator: torch.Generator, count: int) -> str:
    """``count`` random words of w0..w49 (w50..w59 are left for markers)."""
    return " ".join(f"w{int(t)}" for t in torch.randint(0, 50, (count,), generator=generator))


def test_a_long_chat_trains_as_windows_of_whole_exchanges_each_answer_once(chat_target):
    generator = torch.Generator().manual_seed(6)
    messages = []
    for turn in range(6):  # 6 exchanges of 4 + 12 + 6 template ids = 22 tokens: 2 fit in 48
        messages += [
            {"role": "user", "content": words(generator, 4)},
            {"role": "assistant", "content": f"w{50 + turn} " + words(generator, 11)},
        ]
    whole = chat_target.chat_ids(messages, generation_prompt=False)
    assert token_windows(chat_target, messages, len(whole)) == [list(whole)]  # a chat that fits: as before
    windows = token_windows(chat_target, messages, 48)
    assert len(windows) == 3 and all(len(ids) <= 48 for ids in windows)
    markers = answer_markers(chat_target)
    for ids in windows:
        assert ids[:2] == [TURN, USER]  # each window opens as a chat does
        assert answer_positions(ids, markers).any()
    flat = [t for ids in windows for t in ids]
    assert flat == list(whole)  # whole exchanges, in order, each once
    # the control: cut at 48 as before, the chat kept 2 of its 6 answers
    assert sum(t in range(50, 56) for t in whole[:48]) == 2 and sum(t in range(50, 56) for t in flat) == 6


def test_an_exchange_past_max_length_keeps_the_end_of_its_question_and_its_answer(chat_target):
    generator = torch.Generator().manual_seed(7)
    question, answer = words(generator, 100), words(generator, 10)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    (ids,) = token_windows(chat_target, messages, 40)
    vocab = chat_target.tokenizer.get_vocab()
    kept = [vocab[w] for w in question.split()[-20:]]  # max_length // 2 of its last tokens
    assert ids == [TURN, USER, *kept, END, TURN, ASSISTANT, *[vocab[w] for w in answer.split()], END]
    markers = answer_markers(chat_target)
    assert answer_positions(ids, markers).sum() == 11  # the answer and its end
    whole = chat_target.chat_ids(messages, generation_prompt=False)
    assert not answer_positions(list(whole)[:40], markers).any()  # the control: cut from the end, none
    longer = token_windows(chat_target, [*messages[:1], {"role": "assistant", "content": question}], 40)
    assert len(longer[0]) == 40 and longer[0][:2] == [TURN, USER]  # an answer past it all: cut at the end


def test_read_samples_counts_each_window_of_a_long_chat(tmp_path, chat_target):
    generator = torch.Generator().manual_seed(8)
    lines = []
    for _ in range(3):
        messages = []
        for _ in range(4):
            messages += [
                {"role": "user", "content": words(generator, 10)},
                {"role": "assistant", "content": words(generator, 10)},
            ]
        lines.append(json.dumps({"messages": messages}))
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    settings = TrainSettings(data=str(tmp_path / "chats.jsonl"), held_out=2, max_length=60, batch_tokens=120)
    held, train, stats = read_samples(chat_target, settings)
    assert stats.samples == 3 and stats.sequences == 6 and len(held) == 2 and len(train) == 4  # 2 windows a chat


def chats(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(5)
    out = []
    for _ in range(count):
        question = " ".join(f"w{int(t)}" for t in torch.randint(0, 60, (12,), generator=generator))
        answer = " ".join(f"w{int(t)}" for t in torch.randint(0, 60, (8,), generator=generator))
        out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return out


def test_the_answers_loss_reads_only_answer_rows(tmp_path, chat_target):
    from specdecode.heads.model import EagleHead, HeadShape, TargetParts
    from specdecode.training.features import FeatureCache, batch_tensors

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats(6)))
    base = TrainSettings(data=str(path), held_out=1, max_length=64, batch_tokens=128, extract_dtype="float32")
    _, train, _ = read_samples(chat_target, base)
    markers = answer_markers(chat_target)
    cache = FeatureCache(tmp_path / "features", chat_target, torch.float32)
    batch = batch_tensors(cache, "t", train, [0, 1])
    torch.manual_seed(0)
    head = EagleHead(HeadShape.of(chat_target.model))
    parts = TargetParts(chat_target.model, chat_target.vocab_size, torch.arange(chat_target.vocab_size))
    answers = replace(base, loss_rows="answers")
    loss_all, _, ids_all = head_loss(head, parts, batch, base, 1.0, markers=markers)
    loss_answers, _, ids_answers = head_loss(head, parts, batch, answers, 1.0, markers=markers)
    counted = packed_answer_rows(batch[1], batch[2], markers)
    valid = torch.ones_like(counted)
    valid[len(train[0]) - 1] = valid[-1] = False  # each sequence's last row has no next feature
    assert ids_answers.numel() == int((counted & valid).sum()) < ids_all.numel() == int(valid.sum())
    assert not torch.isclose(loss_all, loss_answers)
    # a chat cut off in its prompt has no answer rows: the loss is zero and still trains (a zero gradient)
    cut = batch_tensors(cache, "c", [[TURN, USER, *range(10)]], [0])
    empty, _, no_ids = head_loss(head, parts, cut, answers, 1.0, markers=markers)
    empty.backward()
    assert float(empty.detach()) == 0.0 and no_ids.numel() == 0
    assert all(p.grad is not None and not p.grad.any() for p in head.parameters() if p.requires_grad)
    # a plain text is all answer rows: the two settings train the same
    text = batch_tensors(cache, "x", [list(range(20))], [0])
    assert torch.equal(head_loss(head, parts, text, base, 1.0)[0], head_loss(head, parts, text, answers, 1.0)[0])


def test_train_head_on_answer_rows_records_both_held_out_figures(tmp_path, monkeypatch, chat_target):
    from typer.testing import CliRunner

    import specdecode.cli as cli
    from specdecode import factory

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats(10)))
    settings = TrainSettings(
        data=str(path), held_out=2, max_length=64, batch_tokens=128, extract_dtype="float32", loss_rows="answers"
    )
    result = train_head(chat_target, settings, tmp_path / "head")
    figures = result.by_vocab[chat_target.vocab_size]
    assert len(figures["answers_top1_by_depth"]) == len(figures["top1_by_depth"]) == 5
    config = json.loads(Path(tmp_path / "head" / "config.json").read_text())
    assert config["training"]["settings"]["loss_rows"] == "answers"
    assert config["training"]["held_out_answers_top1_by_depth"] == figures["answers_top1_by_depth"]
    with pytest.raises(ValueError, match="loss_rows"):
        TrainSettings(loss_rows="prompts")
    monkeypatch.setattr(factory, "load", lambda name, *settings: chat_target)
    args = ["train-head", "--data", str(path), "--out", str(tmp_path / "cli"), "--held-out", "2", "--max-length", "64"]
    args += ["--batch-tokens", "128"]
    bad = CliRunner().invoke(cli.app, [*args, "--loss-rows", "prompts"])
    assert bad.exit_code == 2 and "--loss-rows" in bad.output and "Traceback" not in bad.output
    good = CliRunner().invoke(cli.app, [*args, "--loss-rows", "answers"])
    assert good.exit_code == 0, good.output
    assert "answer rows alone" in good.stdout
