"""`specdecode quality`: agreement, perplexity and KL of quantized weights against dense float32, on tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import typer
from helpers.models import quantizable_llama
from helpers.tokenizers import word_tokenizer
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

import specdecode as sd
from specdecode import factory
from specdecode.bench.quality import (
    PROMPTS,
    compare_positions,
    held_out_text,
    measure_quality,
    steps,
    text_chunks,
)
from specdecode.commands.quality import quality

VOCAB = 256


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return quantizable_llama(VOCAB, seed=0, hidden_size=256, weight_std=0.06)


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    return torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(1)).tolist()


PROMPT_IDS = [[3, 1, 4, 1, 5], [9, 2, 6]]


def test_held_out_text_ships_with_the_package():
    assert len(held_out_text().split()) >= 2500


def test_text_chunks():
    assert text_chunks(range(10), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert text_chunks(range(9), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a lone last token predicts nothing
    assert steps(10, settings=2, prompts=5, chunk=4) == (3 + 5) * 3 + 5
    with pytest.raises(ValueError, match="at least 2"):
        text_chunks(range(10), 1)


def test_compare_positions_against_direct_sums():
    generator = torch.Generator().manual_seed(2)
    reference, logits = torch.randn(2, 7, 11, generator=generator)
    next_tokens = torch.randint(0, 11, (7,), generator=generator)
    agreed, nll, kl = compare_positions(reference, logits, next_tokens)
    p, q = reference.double().softmax(-1), logits.double().softmax(-1)
    assert agreed == int((reference.argmax(-1) == logits.argmax(-1)).sum())
    assert nll == pytest.approx(-sum(math.log(q[i, t]) for i, t in enumerate(next_tokens.tolist())))
    assert kl == pytest.approx(float((p * (p / q).log()).sum()))
    assert compare_positions(reference, reference, next_tokens)[::2] == (7, 0.0)


def test_a_setting_agrees_with_itself(model, text_ids):
    loaded = sd.load_model(model, quantization="int8")
    report = measure_quality(loaded, {"int8": loaded}, text_ids, PROMPT_IDS, chunk=64, greedy_tokens=12)
    same = report.settings[0]
    assert same.agreement == same.greedy_agreement == 1.0
    assert same.kl == 0.0
    assert same.perplexity == report.reference.perplexity
    assert same.positions == 150 - 3  # chunks of 64, 64 and 22 tokens: each predicts all but its first
    assert same.greedy_positions == 2 * 12


def test_perplexity_matches_a_direct_computation(model, text_ids):
    """exp(mean NLL) over chunks read from an empty cache, computed by transformers' own forward."""
    report = measure_quality(sd.load_model(model), {}, text_ids, [], chunk=64)
    nll, count = 0.0, 0
    with torch.no_grad():
        for piece in text_chunks(text_ids, 64):
            logits = model(torch.tensor([piece])).logits[0, :-1]
            nll += float(F.cross_entropy(logits.double(), torch.tensor(piece[1:]), reduction="sum"))
            count += len(piece) - 1
    assert report.reference.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert report.reference.positions == count
    assert math.isnan(report.reference.greedy_agreement)  # no prompts, no greedy positions


def test_int8_is_closer_to_float32_than_int4_in_groups_of_256(model, text_ids):
    reference = sd.load_model(model)
    settings = {
        "int8": sd.load_model(model, quantization="int8"),
        "int4": sd.load_model(model, quantization="int4", group_size=256),
    }
    report = measure_quality(reference, settings, text_ids, PROMPT_IDS, chunk=64, greedy_tokens=24)
    int8, int4 = report.settings
    assert int4.agreement < int8.agreement <= 1.0
    assert 0.0 < int8.kl < int4.kl
    assert abs(math.log(int8.perplexity / report.reference.perplexity)) < abs(
        math.log(int4.perplexity / report.reference.perplexity)
    )
    assert int4.greedy_agreement <= int8.greedy_agreement
    assert int4.weight_bytes < int8.weight_bytes < report.reference.weight_bytes


def test_reference_name_is_reserved(model, text_ids):
    loaded = sd.load_model(model)
    with pytest.raises(ValueError, match="reference"):
        measure_quality(loaded, {"float32": loaded}, text_ids, [])


# --- the command -------------------------------------------------------------------------------------------


@pytest.fixture
def invoke(model, monkeypatch):
    """Run `quality` with every model name loading the tiny model with a word tokenizer (``factory.load``)."""
    tokenizer = word_tokenizer([f"w{i}" for i in range(VOCAB)])

    def load(name, dtype, quantization="auto", group_size=32, max_context=None):
        quantization = factory.parse_quantization(quantization)
        return sd.load_model(model, tokenizer=tokenizer, quantization=quantization, group_size=group_size)

    monkeypatch.setattr(factory, "load", load)
    app = typer.Typer()
    app.command()(quality)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


@pytest.fixture
def text_file(tmp_path, text_ids):
    path = tmp_path / "text.txt"
    path.write_text(" ".join(f"w{i}" for i in text_ids))
    return path


def test_cli_json(invoke, text_file):
    result = invoke("--quantization", "int8,int4", "--text", str(text_file), "--max-tokens", "100",
                    "--greedy-tokens", "6", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [s["name"] for s in data["settings"]] == ["int8", "int4 (group 32)"]
    assert data["text_tokens"] == 100 and data["chunk"] == 512
    assert data["reference"]["positions"] == 99
    assert data["reference"]["greedy_positions"] == 6 * len(PROMPTS)
    for setting in data["settings"]:
        assert 0.0 <= setting["agreement"] <= 1.0 and 0.0 <= setting["greedy_agreement"] <= 1.0
        assert setting["kl"] > 0.0 and setting["weight_bytes"] < data["reference"]["weight_bytes"]


def test_cli_table(invoke, text_file):
    result = invoke("--quantization", "int8", "--text", str(text_file), "--greedy-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "against dense float32" in result.stdout and "│ int8 " in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("--quantization", "int3"),
        ("--quantization", "int8,int8"),
        ("--quantization", ""),
        ("--group-size", "7"),
        ("--max-tokens", "1"),
        ("--greedy-tokens", "0"),
        ("--text", "/nonexistent/text.txt"),
        ("--quantization", "gguf"),  # an in-process model has no GGUF blocks
    ],
)
def test_cli_user_mistakes_print_one_line(invoke, args):
    result = invoke(*args, "--json")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")


def test_cli_empty_text(invoke, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("  \n")
    result = invoke("--text", str(path))
    assert result.exit_code == 2 and "empty" in result.stderr
