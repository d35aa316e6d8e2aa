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

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers.reference import no_cache_logits
from test_gguf_load import LAYOUTS, MATRICES, _blocks
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import specdecode as sd
from specdecode import kernels
from specdecode.errors import ModelNotAvailable
from specdecode.models.native.architecture import architecture_of, unsupported_reason

pytestmark = pytest.mark.skipif(kernels.ops("native") is None, reason="the CPU kernels did not build here")

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, CONTEXT = 256, 512, 4, 2, 64, 96, 131072
WINDOW = 8  # every test sequence is longer
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SIZES = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
             num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6,
             tie_word_embeddings=True)  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """A GGUF file to write and the transformers model it means."""

    arch: str
    layers: int
    kinds: tuple[str, ...]  # q, k, v, o, gate, up, down
    base: float
    name: str = "tiny"
    metadata: dict = field(default_factory=dict)  # extra keys: str, float or uint32 values
    rope_freqs: np.ndarray | None = None
    qk_norm: bool = False
    biases: bool = False
    sandwich: bool = False


def llama3_divisors(base: float, dim: int, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter computes it from a Llama 3 config (float32)."""
    divisors = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            divisors.append(1.0)
        elif wavelen > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32).numpy()


LLAMA3_DIVISORS = llama3_divisors(500000.0, HEAD_DIM, 8.0, 1.0, 4.0, 8192)
SPECS = {
    "llama3": Spec("llama", 2, LAYOUTS["k-quants"], 500000.0, "Llama 3.2 1B Instruct", rope_freqs=LLAMA3_DIVISORS),
    "qwen2.5": Spec("qwen2", 2, LAYOUTS["q4-q5"], 1e6, "Qwen2.5 0.5B Instruct", biases=True),
    "qwen3": Spec("qwen3", 2, LAYOUTS["mixed"], 1e6, "Qwen3 0.6B", qk_norm=True),
    "mistral": Spec("llama", 2, LAYOUTS["mixed"], 1e6, "mistral"),  # transformers' guess: Mistral, 4096 window
    "gemma3": Spec("gemma3", 6, ("Q8_0", "Q8_0", "Q8_0", "Q4_K", "Q4_0", "Q4_0", "Q6_K"), 1e6, "Gemma 3 4B",
                   qk_norm=True, sandwich=True, metadata={"gemma3.attention.sliding_window": WINDOW,
                   "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}),
}  # fmt: skip


def expected_config(key: str, spec: Spec):
    """The transformers config the file means, written out by hand (not read from the file)."""
    rope = {"rope_type": "default", "rope_theta": spec.base}
    if key == "llama3":
        return LlamaConfig(**SIZES, num_hidden_layers=spec.layers, rope_parameters={**rope, "rope_type": "llama3",
                           **LLAMA3})  # fmt: skip
    if key == "mistral":  # llama.cpp runs a llama file as Llama: no window unless the file states one
        return LlamaConfig(**SIZES, num_hidden_layers=spec.layers, rope_parameters=rope)
    if key == "qwen2.5":
        return Qwen2Config(**SIZES, num_hidden_layers=spec.layers, rope_parameters=rope)
    if key == "qwen3":
        return Qwen3Config(**SIZES, num_hidden_layers=spec.layers, rope_parameters=rope)
    rope_parameters = {"full_attention": {**rope, "rope_type": "linear", "factor": 8.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    scalar = HEAD_DIM  # llama.cpp scales by 1/sqrt(head_dim) below the 27B
    return Gemma3TextConfig(**SIZES, num_hidden_layers=spec.layers, sliding_window=WINDOW,
                            rope_parameters=rope_parameters, query_pre_attn_scalar=scalar)  # fmt: skip


MODEL_CLASSES = {LlamaConfig: LlamaForCausalLM, MistralConfig: MistralForCausalLM, Qwen2Config: Qwen2ForCausalLM,
                 Qwen3Config: Qwen3ForCausalLM, Gemma3TextConfig: Gemma3ForCausalLM}  # fmt: skip


def write(path: Path, spec: Spec) -> Path:
    """``spec`` as a GGUF file: the keys and tensor names llama.cpp's converter writes for its architecture."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    a = spec.arch
    writer.add_name(spec.name)
    for key, value in {"context_length": CONTEXT, "embedding_length": HIDDEN, "block_count": spec.layers,
                       "feed_forward_length": FFN, "attention.head_count": HEADS, "vocab_size": VOCAB,
                       "attention.head_count_kv": KV_HEADS, "rope.dimension_count": HEAD_DIM,
                       "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM}.items():  # fmt: skip
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", spec.base)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    for key, value in spec.metadata.items():
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)](key, value)
    writer.add_tensor(
        "token_embd.weight", _blocks("Q8_0", VOCAB, HIDDEN, rng), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    if spec.rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", spec.rope_freqs)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = dict(zip(MATRICES, ((q, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, q), (FFN, HIDDEN), (FFN, HIDDEN),
                                 (HIDDEN, FFN)), strict=True))  # fmt: skip
    norms = ("attn_norm", "ffn_norm") + (("post_attention_norm", "post_ffw_norm") if spec.sandwich else ())
    for i in range(spec.layers):
        for name, kind in zip(MATRICES, spec.kinds, strict=True):
            writer.add_tensor(f"blk.{i}.{name}.weight", _blocks(kind, *shapes[name], rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])  # fmt: skip
        for norm in norms:
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        for norm in ("attn_q_norm", "attn_k_norm") if spec.qk_norm else ():
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, HEAD_DIM).astype(np.float32))
        for name in ("attn_q", "attn_k", "attn_v") if spec.biases else ():
            writer.add_tensor(f"blk.{i}.{name}.bias", rng.uniform(-0.5, 0.5, shapes[name][0]).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
    assert loaded.new_runner().uses_kernels
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
    assert relative(runner_logits(loaded, IDS), expected) < 2e-3
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
