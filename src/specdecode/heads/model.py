"""The EAGLE draft head: one decoder layer over the target's own features, read out by the target's LM head.

At position t the head reads the target's last hidden state before the final norm, f_t, and the embedding of
the token at t+1; ``fc`` mixes them (2H → H) and one Llama decoder layer predicts f_{t+1}. The target's
frozen final norm and LM head (restricted to the head's drafting vocabulary) turn a predicted feature into
logits for the token at t+2. Deeper guesses feed the head its own predicted features.

Only ``fc`` and the layer are trained and stored; the embedding, norm and LM head rows are the target's
(``TargetParts``), taken from the target as loaded, so the head drafts for dense or quantized weights alike.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text"})
# Config fields that fix the head's shapes and the meaning of the target's features.
_FINGERPRINT_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "tie_word_embeddings",
)


def text_config(model: nn.Module):
    return model.config.get_text_config()


def config_fingerprint(model: nn.Module) -> str:
    """sha256 (16 hex digits) of the target config fields that the head depends on."""
    config = text_config(model)
    fields = {name: getattr(config, name, None) for name in _FINGERPRINT_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def vocab_fingerprint(tokenizer) -> str | None:
    """sha256 (16 hex digits) of the tokenizer's token → id table, or None without a tokenizer."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def check_supported(model: nn.Module) -> None:
    config = text_config(model)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        kinds = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise ValueError(f"EAGLE heads are built for Llama-family targets ({kinds}); got {config.model_type!r}")


def _rms_scale(norm: nn.Module, model: nn.Module) -> torch.Tensor:
    """A target RMSNorm's scale as a Llama-style norm applies it (float32): Gemma's norms scale by 1 + w."""
    weight = norm.weight.detach().float()
    return 1.0 + weight if text_config(model).model_type == "gemma3_text" else weight


def _mlp_norm(layer: nn.Module) -> nn.Module:
    """A target decoder layer's norm before its MLP (Gemma's sandwich layers: pre_feedforward_layernorm)."""
    return getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm


@dataclass(frozen=True)
class HeadShape:
    """The sizes of the head's decoder layer: those of the target's layers."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool

    @staticmethod
    def of(model: nn.Module) -> HeadShape:
        check_supported(model)
        config = text_config(model)
        attn = model.model.layers[-1].self_attn
        return HeadShape(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=attn.head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in the config (a quantized q_proj may hide it)
            attention_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )


class DecoderLayer(nn.Module):
    """A Llama decoder layer (RMSNorm, grouped-query attention with RoPE, SiLU MLP), parameter names as
    transformers' ``LlamaDecoderLayer`` so the target's last layer can initialise it."""

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.shape = shape
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=shape.attention_bias)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.attention_bias)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.attention_bias)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, h, bias=False)

    def load_target_layer(self, layer: nn.Module, scale: float = 1.0, model: nn.Module | None = None) -> None:
        """Copy the weights of a transformers decoder layer (dense) of ``model``, for a residual stream ``scale``
        times smaller than the target's: the layer's norms ignore the scale, its output projections are divided
        by it. (A Qwen 3 / Gemma 3 layer's query/key and output norms and GeGLU have no place here: an
        initialisation, not a copy.)"""
        attn, mlp = layer.self_attn, layer.mlp
        offset = model is not None and text_config(model).model_type == "gemma3_text"
        sources = {
            "input_layernorm": layer.input_layernorm.weight + (1.0 if offset else 0.0),
            "post_attention_layernorm": _mlp_norm(layer).weight + (1.0 if offset else 0.0),
        }
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sources[f"{name}.weight"] = getattr(attn, name).weight
            if getattr(attn, name).bias is not None:
                sources[f"{name}.bias"] = getattr(attn, name).bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            sources[f"{name}.weight"] = getattr(mlp, name).weight
        with torch.no_grad():
            for name, param in self.named_parameters():
                divide = scale if name in ("o_proj.weight", "down_proj.weight") else 1.0
                param.copy_(sources[name].detach().float() / divide)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``x`` [n, H] at RoPE angles (cos, sin) [n, head_dim], attending to ``past`` keys/values
        [kv_heads, m, head_dim] and to each other as ``mask`` (bool [n, m + n], True = may attend) allows.
        Returns (output [n, H], the rows' keys, values [kv_heads, n, head_dim])."""
        s = self.shape
        n = x.shape[0]
        h = _rms_norm(x, self.input_layernorm, s.rms_norm_eps)
        q = _rope(self.q_proj(h).view(n, s.num_heads, s.head_dim).transpose(0, 1), cos, sin)
        k = _rope(self.k_proj(h).view(n, s.num_kv_heads, s.head_dim).transpose(0, 1), cos, sin)
        v = self.v_proj(h).view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        attn = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True)
        x = x + self.o_proj(attn[0].transpose(0, 1).reshape(n, s.num_heads * s.head_dim))
        h = _rms_norm(x, self.post_attention_layernorm, s.rms_norm_eps)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, k, v


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the weight in the activations' dtype (under bfloat16 autocast: the fused kernel, no warning)."""
    return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class EagleHead(nn.Module):
    """RMS-normalised (f_t, embedding of x_{t+1}) → ``fc`` → one decoder layer → predicted f_{t+1} / s.

    Both inputs are normalised first (as EAGLE-3 does): the target's features are hundreds of times larger
    than its embeddings, and unnormalised the head all but ignored the token. The output is the next feature
    in units of s, the features' typical size (a training constant); the target's final norm, which reads
    it out, and the head's own input norm, which reads it back for a deeper guess, ignore the scale.
    """

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        self.shape = shape
        self.feature_norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.embed_norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.fc = nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=True)
        self.layer = DecoderLayer(shape)

    def forward(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predicted next features [n, H] and the rows' keys and values (see ``DecoderLayer.forward``)."""
        eps = self.shape.rms_norm_eps
        normed = _rms_norm(features, self.feature_norm, eps), _rms_norm(embeddings, self.embed_norm, eps)
        mixed = torch.cat(normed, dim=-1)
        return self.layer(self.fc(mixed), cos, sin, mask, past)

    def to_int8(self) -> EagleHead:
        """Run every linear layer through the int8 weight-only kernel (bfloat16 activations); in place.

        For drafting only: a guess's numerics never change the output, only how often it is accepted, and the
        int8 matrix-vector product reads a quarter of float32's bytes (measured 2-3x faster than bfloat16 here).
        """
        from ..models.formats.weights import Int8Linear, QuantizedLinear

        for parent in [self, self.layer]:
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    kernel = Int8Linear.quantize(child.weight, child.bias)
                    setattr(parent, name, QuantizedLinear(kernel, child.in_features, child.out_features))
        return self.to(torch.bfloat16)


class TargetParts:
    """What the head borrows from its target, frozen: token embeddings, final norm, the LM head's rows for the
    drafting vocabulary, and RoPE's inverse frequencies."""

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        draft_vocab: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        int8: bool = False,
        readout: bool = True,
    ) -> None:
        check_supported(model)
        base = model.model
        config = text_config(model)
        self.embedding = base.embed_tokens
        self.norm_weight = _rms_scale(base.norm, model)
        self.eps = float(config.rms_norm_eps)
        self.hidden_size = config.hidden_size
        self.vocab_size = vocab_size
        device = self.norm_weight.device  # the parts live where the target's weights are
        ids = torch.arange(vocab_size) if draft_vocab is None else draft_vocab
        self.draft_vocab = ids.to(device=device, dtype=torch.int64)
        if self.draft_vocab.numel() and int(self.draft_vocab.max()) >= vocab_size:
            raise ValueError(f"the head's drafting vocabulary names ids past the target's {vocab_size} tokens")
        self.dtype = dtype  # of the embeddings, RoPE tables and LM head rows handed to the head
        from ..models.formats.weights import Int8Linear

        if int8 and dtype != torch.bfloat16:
            raise ValueError(f"the int8 read-out runs on bfloat16 activations, not {dtype}")
        # int8: the rows through the weight-only int8 kernel (drafting only; see EagleHead.to_int8); readout=False:
        # none kept (a caller that reads out on its own, as drafting on the compiled kernels does)
        rows = lm_head_rows(model)[self.draft_vocab] if readout else None
        self.lm_rows = None if int8 or rows is None else rows.to(dtype)
        self._int8_rows = Int8Linear.quantize(rows) if int8 and rows is not None else None
        rotary = base.rotary_emb
        kind = "full_attention_" if hasattr(rotary, "full_attention_inv_freq") else ""  # Gemma: the global base
        self.inv_freq = getattr(rotary, f"{kind}inv_freq").detach().float()
        self.attention_scaling = float(getattr(rotary, f"{kind}attention_scaling"))

    @torch.no_grad()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens).to(self.dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] at integer ``positions``, as transformers' rotary embedding computes them."""
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        scale = self.attention_scaling
        return (angles.cos() * scale).to(self.dtype), (angles.sin() * scale).to(self.dtype)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the drafting vocabulary [n, V_draft] of (pre-norm) features [n, H] (the norm in float32)."""
        normed = F.rms_norm(features.float(), (self.hidden_size,), self.norm_weight, self.eps).to(self.dtype)
        if self._int8_rows is not None:
            return self._int8_rows(normed).float()
        if self.lm_rows is None:
            raise RuntimeError("these TargetParts keep no LM head rows (readout=False)")
        return (normed @ self.lm_rows.T).float()

    def to_vocab(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Token ids of drafting-vocabulary indices."""
        return self.draft_vocab[draft_ids]


@torch.no_grad()
def lm_head_rows(model: nn.Module) -> torch.Tensor:
    """The LM head's weight rows [V, H] in float32, dequantized if the head is stored quantized."""
    from ..models.formats.weights import QuantizedLinear

    head = model.get_output_embeddings()
    if isinstance(head, QuantizedLinear):
        if head.exact_rows is not None:
            return head.exact_rows(torch.arange(head.out_features))
        return head.kernel.dequantize()
    return head.weight.detach().float()


def unrolled(
    head: EagleHead,
    parts: TargetParts,
    features: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    passes: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The head run as it drafts, ``passes`` guesses deep, over packed sequences in one batch.

    ``features`` [T, H] are the target's, ``tokens`` [T] the text, ``positions`` [T] restart at 0 where a new
    sequence begins. Pass 0 reads the true f_t; pass j reads its own pass j-1 prediction from row t-1, and row
    t attends to true rows up to t-j plus its own chain of guesses (as at depth j+1 of drafting). Returns, per
    pass, (predicted f_{t+1} [T, H], rows that have a target: bool [T]).
    """
    n = tokens.shape[0]
    index = torch.arange(n, device=tokens.device)
    start = index - positions  # first row of each row's sequence
    same = start[:, None] == start[None, :]
    has_next = torch.zeros(n, dtype=torch.bool, device=tokens.device)
    has_next[:-1] = start[1:] == start[:-1]
    embeddings = parts.embed(torch.cat([tokens[1:], tokens[:1]]))
    cos, sin = parts.rope(positions)
    inputs = features
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    out = []
    for j in range(passes):
        blocks = [same & (index[None, :] <= index[:, None] - j)]
        blocks += [index[None, :] == index[:, None] - j + i for i in range(1, j + 1)]
        predicted, keys, values = head(inputs, embeddings, cos, sin, torch.cat(blocks, dim=1), past)
        out.append((predicted, has_next & (positions >= j)))
        past = (keys, values) if past is None else (torch.cat([past[0], keys], 1), torch.cat([past[1], values], 1))
        inputs = torch.cat([predicted.new_zeros(1, predicted.shape[1]), predicted[:-1]])
    return out
