"""The architectures people download, each as a tiny GGUF written here the way llama.cpp's converter writes it
(random blocks, no tokenizer): Llama 3.x (its RoPE scaling as a ``rope_freqs.weight`` tensor), Qwen 2.5 (q/k/v
biases), Qwen 3 (q/k norms), Mistral (a llama file), Gemma 3 (sandwich norms, a sliding window, linear RoPE scaling
on its global layers).

Each one loads on the native runner from its blocks; its config is what the file means (what transformers' GGUF
reader drops put back, as llama.cpp reads it); its logits are transformers' forward of that config over the
weights transformers itself dequantizes from the file; a k-token pass is bitwise k one-token steps and greedy
speculation is plain decoding token for token. A file the native runner cannot run goes to transformers and
``describe()`` says why in one line; a file neither can run faithfully is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.architectures import (
    HEAD_DIM,
    MODEL_CLASSES,
    SIZES,
    SPECS,
    VOCAB,
    WINDOW,
    Spec,
    expected_config,
    llama3_divisors,
    write,
)
from helpers.gguf import LAYOUTS
from helpers.kernels import runs_kernels
from helpers.reference import no_cache_logits
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
)

import specdecode as sd
from specdecode.errors import ModelNotAvailable
from specdecode.models.native.architecture import architecture_of, unsupported_reason

# The torch fallback (SPECDECODE_KERNELS=0) holds 4-bit blocks as int4 with bfloat16 scales and offsets and runs
# bfloat16 activations: these random files' logits measured 0.8-2.7% from the dense forward (the kernels: < 0.2%).
FALLBACK_ERROR = 0.04


def transformers_weights(path: Path, config) -> dict[str, torch.Tensor]:
    """The file's weights as transformers' own GGUF loader dequantizes them into a model of ``config`` (Mistral's
    as Llama's: the same parameters, which transformers can name the file's tensors of)."""
    if config.model_type == "mistral":
        config = LlamaConfig(**SIZES, num_hidden_layers=config.num_hidden_layers)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)
    return model.state_dict()


def reference(config, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = MODEL_CLASSES[type(config)](config).eval()
    model.load_state_dict(weights)
    return model


def runner_logits(loaded: sd.LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """A prefill, one step, then a chain: every shape of pass the decoder makes."""
    runner = loaded.new_runner()
    with torch.inference_mode():
        return torch.cat([runner.forward(ids[:40]), runner.forward(ids[40:41]), runner.forward(ids[41:])])


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


IDS = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("key", list(SPECS))
def test_each_architecture_runs_natively_from_its_blocks_with_transformers_logits_for_what_the_file_means(
    key, tmp_path, cache
):
    """(a) native, on the kernels, from the file's blocks; (b) the dense native forward is transformers' forward of
    the hand-written config to float32 tolerance, and the blocks (int16 activations, a float16 cache) within 2e-3;
    the control: where transformers' own reading of the file differs (Llama 3's and Gemma 3's RoPE scaling, Gemma
    3's attention scale), its logits miss by more than the tolerance, so a loader that dropped them would fail."""
    spec = SPECS[key]
    path = write(tmp_path / f"{key}.gguf", spec)
    loaded = sd.load_model(path)
    assert loaded.backend == "native" and loaded.quantization == "gguf", loaded.describe()
    assert loaded.new_runner().uses_kernels is runs_kernels()
    assert not any(p.is_meta for p in loaded.model.parameters())
    assert "dense" not in {p.name for p in cache.iterdir()} and loaded.tokenizer is None
    config = expected_config(key, spec)
    assert loaded.model.config.model_type == config.model_type
    assert loaded.model.config.rope_parameters == config.rope_parameters
    weights = transformers_weights(path, config)
    model = reference(config, weights)
    expected = no_cache_logits(model, IDS)
    for name, buffer in model.model.rotary_emb.named_buffers():  # the RoPE the native runner's tables come from
        assert torch.equal(dict(loaded.model.model.rotary_emb.named_buffers())[name], buffer), name
    assert architecture_of(loaded.model).scaling == model.model.layers[0].self_attn.scaling
    dense = sd.load_model(path, quantization=None)
    assert dense.backend == "native"
    tolerance = 1e-4 * expected.abs().max().item()
    torch.testing.assert_close(runner_logits(dense, IDS), expected, atol=tolerance, rtol=0)
    assert relative(runner_logits(loaded, IDS), expected) < (2e-3 if runs_kernels() else FALLBACK_ERROR)
    if key in ("llama3", "gemma3"):
        as_transformers_reads_it = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).config
        missed = no_cache_logits(reference(as_transformers_reads_it, weights), IDS)
        assert (missed - expected).abs().max() > 10 * tolerance


@pytest.mark.parametrize("key", list(SPECS))
def test_each_architecture_is_row_invariant_and_greedy_speculation_is_plain_decoding(key, tmp_path, cache):
    """(c) a k-token pass is bitwise k one-token steps on the loaded blocks, past Gemma's window; prompt lookup
    at temperature 0 gives plain decoding's tokens, one for one."""
    loaded = sd.load_model(write(tmp_path / f"{key}.gguf", SPECS[key]))
    runner = loaded.new_runner()
    with torch.inference_mode():
        runner.prefill(IDS[:50])
        together = runner.forward(IDS[50:58])
        runner.rollback_to(50)
        singles = torch.cat([runner.forward(IDS[i : i + 1]) for i in range(50, 58)])
    assert torch.equal(together, singles)
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
    prompt = IDS[:24].tolist() * 2  # repeats, so that prompt lookup drafts
    plain = sd.autoregressive_generate(loaded, prompt, params)
    out = sd.SpeculativeDecoder(loaded, sd.PromptLookupProposer(), gamma=4).generate(prompt, params)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0


def test_llama3_scaling_fitted_from_other_divisors_gives_the_files_frequencies(tmp_path, cache):
    """Divisors of other Llama 3 parameters (only the ratios of context, low and high matter): the loaded RoPE
    divides each inverse frequency by the file's divisor, as llama.cpp does, to float32 rounding."""
    divisors = llama3_divisors(10000.0, HEAD_DIM, 16.0, 2.0, 6.0, 64)
    spec = Spec("llama", 2, LAYOUTS["q4-q5"], 10000.0, rope_freqs=divisors)
    loaded = sd.load_model(write(tmp_path / "odd.gguf", spec))
    assert loaded.backend == "native" and loaded.model.config.rope_parameters["rope_type"] == "llama3"
    base = 1.0 / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    inv_freq = loaded.model.model.rotary_emb.inv_freq.double().numpy()
    np.testing.assert_allclose(inv_freq, base / divisors, rtol=1e-5)
    assert not np.allclose(inv_freq, base, rtol=1e-2)


def test_a_linear_scaling_key_gives_transformers_linear_rope(tmp_path, cache):
    """``{arch}.rope.scaling.type`` linear (dropped by transformers' reader): every inverse frequency over the
    factor, on the native runner."""
    metadata = {"qwen3.rope.scaling.type": "linear", "qwen3.rope.scaling.factor": 4.0}
    loaded = sd.load_model(write(tmp_path / "linear.gguf", Spec(**{**SPECS["qwen3"].__dict__, "metadata": metadata})))
    assert loaded.backend == "native"
    assert loaded.model.config.rope_parameters == {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}
    base = 1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM)
    assert torch.equal(architecture_of(loaded.model).ropes[0].inv_freq, base / 4.0)


def _fallback(tmp_path: Path, key: str, **changes) -> tuple[sd.LoadedModel, Path]:
    spec = SPECS[key]
    spec = Spec(**{**spec.__dict__, **changes})
    path = write(tmp_path / f"{key}-fallback.gguf", spec)
    return sd.load_model(path), path


def test_a_stated_mistral_window_runs_on_transformers_and_says_why(tmp_path, cache):
    """(d) a llama file that states a sliding window is Mistral with it: transformers runs it (the window honoured:
    its logits are MistralForCausalLM's with that window), and ``describe()`` names the reason in one line."""
    loaded, path = _fallback(tmp_path, "mistral", name="Mistral 7B v0.1",
                             metadata={"llama.attention.sliding_window": WINDOW})  # fmt: skip
    assert loaded.backend == "transformers" and loaded.model.config.sliding_window == WINDOW
    assert unsupported_reason(loaded.model) == "Mistral's sliding window"
    line = loaded.describe()
    assert "\n" not in line and "not native: Mistral's sliding window" in line, line
    config = MistralConfig(**SIZES, num_hidden_layers=2, sliding_window=WINDOW, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6})  # fmt: skip
    expected = no_cache_logits(reference(config, transformers_weights(path, config)), IDS)
    torch.testing.assert_close(runner_logits(loaded, IDS), expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


def test_gemma3_with_a_final_softcap_runs_on_transformers_and_says_why(tmp_path, cache):
    metadata = {**SPECS["gemma3"].metadata, "gemma3.final_logit_softcapping": 30.0}
    loaded, _ = _fallback(tmp_path, "gemma3", metadata=metadata)
    assert loaded.backend == "transformers" and loaded.model.config.final_logit_softcapping == 30.0
    assert "not native: final_logit_softcapping is set" in loaded.describe()


@pytest.mark.parametrize(
    ("key", "changes", "message"),
    [
        ("qwen2.5", {"metadata": {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0}},
         "RoPE scaling 'yarn'"),
        ("llama3", {"rope_freqs": np.linspace(1.0, 3.0, HEAD_DIM // 2).astype(np.float32)},
         "not Llama 3's RoPE scaling"),
    ],
)  # fmt: skip
def test_what_neither_runner_would_compute_as_the_file_means_is_refused_in_one_line(
    key, changes, message, tmp_path, cache
):
    """A RoPE scaling a transformers config cannot state is refused, not run without it (transformers' own loader
    drops it silently)."""
    with pytest.raises(ModelNotAvailable, match=message) as error:
        _fallback(tmp_path, key, **changes)
    assert "\n" not in str(error.value)
