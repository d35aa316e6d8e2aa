"""Tiny random models built in-process (no downloads).

One builder makes every family's tiny model (``tiny_model``: Llama, Mistral, Qwen 2, Qwen 3, Gemma 3); the engine's
tests use 2-layer Llamas with peaked next-token distributions (the LM head is scaled up), so that
distribution tests have power. ``eos_token_id`` is None by default: a random model would otherwise stop
at whichever id was chosen and the exact-distribution tests would have to model EOS too; tests that need
an EOS set one on a copy of the ``LoadedModel`` (``with_eos``).

Drafts are the target with seeded Gaussian noise added to every weight: a different model (its own seed)
that agrees with the target often but not always, so both the accept and the reject paths run a lot.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import specdecode as sd
from helpers.tokenizers import WORDS, word_tokenizer

SMALL_VOCAB = 16
LARGE_VOCAB = 64


# Every family the runners run, each a config and model class; ``tiny_model`` builds any of them.
FAMILY_MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}
TINY = dict(  # a tiny decoder, with no EOS (a random model would stop at whichever id one names)
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def tiny_model(
    family: str, vocab_size: int, seed: int, logit_scale: float = 1.0, weight_std: float = 0.2, **config
) -> PreTrainedModel:
    """A random model of ``family`` (``FAMILY_MODELS``) in ``TINY``'s sizes, ``config`` overriding them: weights
    N(0, weight_std²) and norms U(0.5, 1.5) drawn from ``seed``, the LM head scaled by ``logit_scale`` (a peaked
    law, so that distribution tests have power). The one builder of every test's random model."""
    config_cls, model_cls = FAMILY_MODELS[family]
    model = randomized(model_cls(config_cls(**(TINY | {"vocab_size": vocab_size} | config))).eval(), seed, weight_std)
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model


def tiny_llama(vocab_size: int, seed: int, logit_scale: float = 3.0, num_layers: int = 2) -> LlamaForCausalLM:
    """A random 2-layer Llama (hidden 32) whose logits are scaled by ``logit_scale`` (entropy ≈ 1.3 nats)."""
    return tiny_model("llama", vocab_size, seed, logit_scale, num_hidden_layers=num_layers)


def word_target(
    seed: int = 10,
    num_layers: int = 2,
    words: list[str] = WORDS,
    eos: str | None = None,
    chat_template: str | None = None,
    **load,
) -> sd.LoadedModel:
    """``tiny_llama(len(words), seed)`` with a word tokenizer (id i is ``words[i]``), to run on text; seed 10 is
    ``large_target``'s weights. ``load`` goes to ``sd.load_model`` (backend, max_context)."""
    tokenizer = word_tokenizer(words, eos=eos)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return sd.load_model(tiny_llama(len(words), seed, num_layers=num_layers), tokenizer=tokenizer, **load)


def randomized(model: PreTrainedModel, seed: int, weight_std: float) -> PreTrainedModel:
    """``model`` with weights N(0, weight_std²) and norm scales U(0.5, 1.5), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            else:
                param.copy_(weight_std * torch.randn(param.shape, generator=generator))
    return model


def quantizable_llama(
    vocab_size: int, seed: int, hidden_size: int = 128, weight_std: float | None = None
) -> LlamaForCausalLM:
    """A random 2-layer Llama whose layer sizes suit every weight format (int4 packs rows in blocks of 64):
    MLP twice as wide as ``hidden_size``; weights N(0, weight_std²) and norms U(0.5, 1.5) when ``weight_std``
    is given, else transformers' own initialisation (seeded)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model if weight_std is None else randomized(model, seed, weight_std)


def perturbed(model: LlamaForCausalLM, seed: int, noise: float) -> LlamaForCausalLM:
    """A copy of ``model`` with N(0, (noise·std(W))²) added to every weight W: a related but different draft."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    return draft


def with_eos(model: sd.LoadedModel, *eos_ids: int) -> sd.LoadedModel:
    """The same model and weights, ending generation at ``eos_ids``."""
    return dataclasses.replace(model, eos_token_ids=frozenset(eos_ids))


def train_word_head(target: sd.LoadedModel, words: list[str], tmp_path_factory, name: str):
    """An EAGLE head trained briefly for ``target`` (a word-tokenizer model) on 16 of its own sampled
    continuations, drafting over the 56 ids it predicted most; returns the head's folder."""
    from specdecode.training.train import TrainSettings, train_head

    corpus = tmp_path_factory.mktemp(f"{name}-corpus")
    generator = torch.Generator().manual_seed(3)
    for i in range(16):
        prompt = torch.randint(0, target.vocab_size, (3,), generator=generator).tolist()
        out = sd.autoregressive_generate(target, prompt, sd.SamplingParams(temperature=0.7, max_new_tokens=45, seed=i))
        (corpus / f"{i}.txt").write_text(" ".join(words[t] for t in prompt + out.token_ids))
    settings = TrainSettings(
        data=str(corpus), held_out=2, max_length=48, batch_tokens=96, epochs=4, lr=3e-3, warmup_steps=2,
        draft_vocab=56, extract_dtype="float32",
    )  # fmt: skip
    folder = tmp_path_factory.mktemp(name) / "head"
    train_head(target, settings, folder)
    return folder


def weakened(model: torch.nn.Module, layers: set[int], scale: float) -> torch.nn.Module:
    """``model`` with the residual writes (o_proj, down_proj) of ``layers`` scaled: skipping them changes less."""
    with torch.no_grad():
        for i in layers:
            model.model.layers[i].self_attn.o_proj.weight.mul_(scale)
            model.model.layers[i].mlp.down_proj.weight.mul_(scale)
    return model
