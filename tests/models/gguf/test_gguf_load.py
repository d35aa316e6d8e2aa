"""A GGUF file loads from its own blocks: config from its metadata, the skeleton without weights, the blocks
straight into the kernels' layout. Nothing but the config (and a tokenizer, when the file has one) is written to
the cache, and the logits are bitwise those of the earlier path (a float32 dense copy, then the file's blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.gguf import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, LAYOUTS, VOCAB, write_gguf
from helpers.kernels import needs_kernels, runs_kernels, unavailable
from transformers import AutoModelForCausalLM

import specdecode as sd
from specdecode import kernels
from specdecode.errors import ModelNotAvailable
from specdecode.models.gguf import conversions as gguf_cache
from specdecode.models.loading import loader
from specdecode.models.loading.quantize import Quantization, quantize_model


def _logits(loaded: sd.LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    runner = loaded.new_runner()
    with torch.inference_mode():
        return torch.cat([runner.forward(ids[:40]), runner.forward(ids[40:41]), runner.forward(ids[41:])])


def _earlier_path(path: Path) -> sd.LoadedModel:
    """What load_model did before: a float32 dense copy on disk, loaded, then its linears swapped for the blocks."""
    model = AutoModelForCausalLM.from_pretrained(gguf_cache.dense_cache(path), dtype=torch.float32).eval()
    formats = quantize_model(model, Quantization("gguf"), path)
    loaded = loader._wrap(model, None, path.name, "auto")
    loaded.quantization, loaded.formats = "gguf", formats
    return loaded


def _written(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)).split("/")[0] for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_gguf_loads_from_its_blocks_without_a_dense_copy_and_computes_the_earlier_paths_logits(
    layout, tmp_path, cache
):
    path = write_gguf(tmp_path / f"{layout}.gguf", LAYOUTS[layout])
    loaded = sd.load_model(path)
    assert loaded.backend == "native" and loaded.quantization == "gguf"
    assert loaded.new_runner().uses_kernels is runs_kernels()
    assert not any(p.is_meta for p in loaded.model.parameters())
    written = _written(cache)
    assert "dense" not in written and "gguf" in written, written  # the config only: no weights on disk
    assert not any(f.suffix == ".safetensors" for f in (cache / "gguf").rglob("*"))
    assert loaded.tokenizer is None  # the file has none: prompts are token ids
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    earlier = _earlier_path(path)
    assert earlier.formats == loaded.formats
    assert torch.equal(_logits(loaded, ids), _logits(earlier, ids))


def test_the_loaded_blocks_are_row_invariant_and_greedy_speculation_is_plain_decoding(tmp_path, cache):
    loaded = sd.load_model(write_gguf(tmp_path / "mixed.gguf", LAYOUTS["mixed"]))
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(2))
    assert _row_invariant(loaded, ids)
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
    prompt = ids[:30].tolist() * 2  # repeats, so that prompt lookup drafts
    plain = sd.autoregressive_generate(loaded, prompt, params)
    out = sd.SpeculativeDecoder(loaded, sd.PromptLookupProposer(), gamma=4).generate(prompt, params)
    assert out.token_ids == plain.token_ids


def _row_invariant(loaded: sd.LoadedModel, ids: torch.Tensor) -> bool:
    """Whether a k-row pass gives bitwise its k one-row steps (after a 50-token prefill)."""
    runner = loaded.new_runner()
    with torch.inference_mode():
        runner.prefill(ids[:50])
        together = runner.forward(ids[50:58])
        runner.rollback_to(50)
        singles = torch.cat([runner.forward(ids[i : i + 1]) for i in range(50, 58)])
    return torch.equal(together, singles)


@pytest.fixture(scope="module")
def build(request) -> str:
    """A kernels build (``kernels.VARIANTS``) loaded before a test's fresh cache would build it again, or a skip."""
    cpuinfo = Path("/proc/cpuinfo")
    if request.param == "avx2" and (not cpuinfo.exists() or "avx2" not in cpuinfo.read_text()):
        pytest.skip("this CPU has no AVX2")
    if kernels.ops(request.param) is None:
        unavailable(f"the {request.param} build failed here")
    return request.param


@needs_kernels
@pytest.mark.parametrize("build", ["native", "avx2"], indirect=True)
def test_five_bit_blocks_held_in_high_bit_planes_give_the_one_byte_formats_logits_in_less_memory(
    build, tmp_path, cache, monkeypatch
):
    """Q5_0 / Q5_1 / Q5_K matrices and a tied Q5_0 embedding-head, held as nibbles + a plane of fifth bits, give
    bitwise the logits of the same file held one byte per weight (``HIGH_BIT_PLANES`` off: the earlier format) on
    the ``build`` given, and those of the native build; k-row passes are bitwise their one-row steps; the weights
    held shrink by exactly 3/8 of a byte per 5-bit weight."""
    from specdecode.models import memory
    from specdecode.models.formats import kernel_linear

    path = write_gguf(tmp_path / "five.gguf", LAYOUTS["five-bit"], embedding="Q5_0")
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(4))
    native = _logits(sd.load_model(path), ids)
    monkeypatch.setenv("SPECDECODE_KERNELS", build)
    planes = sd.load_model(path)
    monkeypatch.setattr(kernel_linear, "HIGH_BIT_PLANES", False)
    as_bytes = sd.load_model(path)
    assert planes.new_runner().uses_kernels and as_bytes.new_runner().uses_kernels
    assert torch.equal(_logits(planes, ids), _logits(as_bytes, ids))
    assert torch.equal(_logits(planes, ids), native)
    assert _row_invariant(planes, ids)
    kv = KV_HEADS * HIDDEN // HEADS
    per_layer = 2 * HIDDEN * HIDDEN + 2 * kv * HIDDEN + 3 * FFN * HIDDEN
    five_bit_weights = LAYERS * per_layer + VOCAB * HIDDEN  # every matrix and the head (its rows: whole tiles)
    saved = memory.loaded_footprint(as_bytes).repacked - memory.loaded_footprint(planes).repacked
    assert saved == five_bit_weights * 3 // 8


def test_an_untied_head_runs_its_own_blocks_and_the_dense_load_dequantizes_the_same_file(tmp_path, cache):
    path = write_gguf(tmp_path / "untied.gguf", LAYOUTS["k-quants"], head="Q6_K")
    loaded = sd.load_model(path)
    assert loaded.formats["Q6_K head" if runs_kernels() else "int8 head"] == 1  # the fallback: int8 rows
    dense = sd.load_model(path, quantization=None)  # every weight dequantized in memory, none on disk
    assert "dense" not in _written(cache)
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(3))
    quantized, reference = _logits(loaded, ids), _logits(dense, ids)
    # the kernels: int16 activations, a float16 cache; the fallback (SPECDECODE_KERNELS=0): Q4_K as int4 with
    # bfloat16 scales and offsets, bfloat16 activations — 12.8% measured on these random K-quant blocks
    assert (quantized - reference).norm() / reference.norm() < (2e-3 if runs_kernels() else 0.15)
    earlier = AutoModelForCausalLM.from_pretrained(gguf_cache.dense_cache(path), dtype=torch.float32)
    for name, param in earlier.state_dict().items():  # the dense load holds the earlier dense copy's weights
        assert torch.equal(dense.model.state_dict()[name], param), name


def test_a_file_of_an_architecture_transformers_cannot_read_is_refused_in_one_line(tmp_path, cache):
    path = write_gguf(tmp_path / "odd.gguf", LAYOUTS["q4-q5"], architecture="notamodel")
    with pytest.raises((ModelNotAvailable, ValueError), match="notamodel"):
        sd.load_model(path)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "gemma3"])
def test_a_file_without_a_tokenizer_gets_none_whatever_its_architecture(architecture, tmp_path, cache):
    """From a folder with a config and no tokenizer files, transformers builds an empty tokenizer of a Qwen or Gemma
    config's class (1 to 5 tokens), which would cut the vocabulary to it: the file has none, so None."""
    path = write_gguf(tmp_path / f"{architecture}.gguf", LAYOUTS["q4-q5"], architecture=architecture)
    assert loader.load_tokenizer(str(path)) is None


def test_a_load_says_so_on_stderr_only_when_it_runs_past_the_threshold(tmp_path, cache, capfd, monkeypatch):
    """A load past ``SLOW_LOAD_SECONDS`` prints one line naming the file and its size; a quick one prints nothing
    (the control: the same load under the default 2 s threshold)."""
    path = write_gguf(tmp_path / "mixed.gguf", LAYOUTS["mixed"])
    sd.load_model(path)  # the metadata cached: the loads below are the same work
    capfd.readouterr()
    sd.load_model(path)
    assert "loading" not in capfd.readouterr().err
    monkeypatch.setattr(loader, "SLOW_LOAD_SECONDS", 0.0)
    sd.load_model(path)
    lines = [line for line in capfd.readouterr().err.splitlines() if "loading" in line]
    assert lines == [f"specdecode: loading mixed.gguf ({path.stat().st_size / 1e9:.2f} GB) ..."]
