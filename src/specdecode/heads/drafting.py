"""The EAGLE head's drafting passes: rows appended to the head's own KV cache, and their read-out.

``TorchHead`` runs the head module with torch ops (any device, any dtype): ~30 small ops a step, whose dispatch
alone costs more on a CPU than the head's ~9 MB of int8 weights take to read. ``KernelHead`` runs a step as one
call into the compiled kernels (``kernels/``: ``head_step``): the input norms, ``fc``, the head's decoder
layer (its KV cache static, float16, in the kernels' layout: rollback is a length reset), the target's final
norm and the drafting vocabulary's LM-head rows.

The head's two input norm scales are folded into ``fc``'s columns (norm(x)·w then W equals norm(x) then
W·diag(w)), so unit-scale norms serve both inputs. Weights are integer blocks of 32 (8-bit symmetric, or
4-bit) with int8 activations: drafting numerics never change the output, only how often a guess is accepted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..models.formats.blocks import IntBlocks
from ..models.formats.kernel_linear import KernelLinear
from ..models.native.layers import KERNEL_CACHE_DTYPE
from .model import EagleHead, TargetParts

WEIGHT_BITS = (8, 4)
_GROUP = 32
_LANES = 16  # the kernels' key tiles hold 16 slots
_NO_SLOTS = torch.zeros(0, dtype=torch.int64)
_MEMO_ROWS = 8  # steps of up to this many rows read embeddings from the memo
_MEMO_TOKENS = 4096  # the memo's bound for tokens outside the drafting vocabulary (rows of hidden_size float32)


def kernel_blocks(weight: torch.Tensor, bits: int) -> IntBlocks:
    """``weight`` [N, K] as integer blocks of 32 per row with float16 scales (2 bytes a block, as GGUF's): 8 bits
    symmetric (w = s·(u − 128), s ≥ max|w| / 127, as Q8_0) or 4 bits asymmetric (w = s·u + m, 16 levels from
    each block's min m, as Q4_1)."""
    if bits not in WEIGHT_BITS:
        raise ValueError(f"head weights are 8 or 4 bits, got {bits}")
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // _GROUP, _GROUP)
    if bits == 8:
        scale = _half_at_least(groups.abs().amax(-1) / 127)
        u = torch.round(groups / scale[..., None]).clamp(-127, 127) + 128
        return IntBlocks(u.to(torch.uint8).reshape(n, k), scale, None, 128, _GROUP, 8, half_scales=True)
    low = groups.amin(-1).half().float()  # m ≤ every weight is not needed: u is clamped to 0..15
    scale = _half_at_least((groups.amax(-1) - low) / 15)
    u = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return IntBlocks(u.to(torch.uint8).reshape(n, k), scale, low, -1, _GROUP, 4, half_scales=True)


def _half_at_least(x: torch.Tensor) -> torch.Tensor:
    """Each value rounded up to a (positive, normal) float16, as float32."""
    tiny = torch.finfo(torch.float16).tiny
    half = x.clamp(tiny, torch.finfo(torch.float16).max).half()
    half = torch.where(half.float() < x, torch.nextafter(half, half.new_tensor(torch.inf)), half)
    return half.float()


@dataclass(frozen=True)
class TreeRows:
    """The cache slots each of a step's new rows sees (a level of a token tree): slots ``0..prefix-1``, then the
    row's ``extras`` (ascending: its ancestors' slots, its own slot last)."""

    prefix: int
    extras: list[list[int]]

    def mask(self, length: int) -> torch.Tensor:
        """As an attention mask [rows, length] (True = may attend)."""
        mask = torch.zeros(len(self.extras), length, dtype=torch.bool)
        mask[:, : self.prefix] = True
        rows = [row for row, slots in enumerate(self.extras) for _ in slots]
        mask[rows, [slot for slots in self.extras for slot in slots]] = True
        return mask


def supports_kernel_head(head: EagleHead, kernels) -> bool:
    """Whether ``KernelHead`` can run ``head`` on ``kernels``: every matrix's inputs in whole blocks of 32, and
    attention heads the kernels' decoder takes (a multiple of 16 values, at most 256)."""
    s = head.shape
    inputs = (s.hidden_size, s.intermediate_size, s.num_heads * s.head_dim)
    return kernels is not None and all(n % _GROUP == 0 for n in inputs) and s.head_dim % 16 == 0 and s.head_dim <= 256


class TorchHead:
    """The head's rows appended to its own KV cache, and their read-out, with torch ops (the head module as
    trained; any device and dtype; int8 matrices through torch's weight-only kernel when the head was converted).

    Cache entry t is the t-th row appended since the last ``truncate`` below it; ``step`` adds rows (causal, or
    a tree level's rows as ``TreeRows`` say) and ``truncate`` forgets entries past a length.
    """

    def __init__(self, head: EagleHead, parts: TargetParts, dtype: torch.dtype) -> None:
        shape = head.shape
        self.head = head
        self.parts = parts
        self._empty = torch.zeros(shape.num_kv_heads, 0, shape.head_dim, dtype=dtype)
        self._keys, self._values = self._empty, self._empty

    @property
    def length(self) -> int:
        return self._keys.shape[1]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cache entries."""
        self._keys, self._values = self._keys[:, :length], self._values[:, :length]

    @torch.inference_mode()
    def step(
        self,
        features: torch.Tensor,
        tokens: list[int],
        positions: list[int],
        tree: TreeRows | None = None,
        read_from: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head rows for (f_t [n, H], token t+1) at RoPE ``positions``, appended to the cache at entries
        ``length..``: causal (row i sees entries ``..length + i``) or as ``tree`` says.
        Returns the predicted features [n, H] (in units of the head's feature scale) and the logits over the
        drafting vocabulary of rows ``read_from..`` [n - read_from, V_draft] (float32)."""
        n = len(tokens)
        if tree is None:
            mask = torch.ones(n, self.length + n, dtype=torch.bool).tril(self.length)
        else:
            mask = tree.mask(self.length + n)
        cos, sin = self.parts.rope(torch.tensor(positions, dtype=torch.int64))
        features = features.to(self._empty.dtype)
        embeddings = self.parts.embed(torch.tensor(tokens, dtype=torch.int64))
        out, keys, values = self.head(features, embeddings, cos, sin, mask, (self._keys, self._values))
        self._keys, self._values = torch.cat([self._keys, keys], 1), torch.cat([self._values, values], 1)
        return out, self.parts.logits(out[read_from:])


class KernelHead:
    """As ``TorchHead``, on the compiled kernels: one ``head_step`` call per step (norms, ``fc``, the decoder
    layer, the final norm and read-out); the KV cache static (entry t at slot t, rollback a length reset).

    ``bits``: fc's and the layer's weights; ``readout_bits``: the LM-head rows'. On the shipped SmolLM2 head
    (docs/BENCHMARKS.md) 4-bit layer weights cost ~4 points of first-guess acceptance and a 4-bit read-out 2-2.5
    points (8 bits match float32 drafting) for ~0.02-0.08 ms a pass saved: hence 8 bits for both by default."""

    def __init__(
        self,
        head: EagleHead,
        parts: TargetParts,
        readout_rows: torch.Tensor,
        kernels,
        bits: int = 8,
        readout_bits: int = 8,
    ) -> None:
        if bits not in WEIGHT_BITS or readout_bits not in WEIGHT_BITS:
            raise ValueError(f"head weights are 8 or 4 bits, got {bits} and {readout_bits}")
        s = head.shape
        self.shape = s
        self.parts = parts
        self._ops = kernels
        self._layer = -1
        with torch.no_grad():
            fc = head.fc.weight.detach().float()
            scales = torch.cat([head.feature_norm.detach().float(), head.embed_norm.detach().float()])
            self._fc = self._matrix(fc * scales, head.fc.bias, bits)
            layer = head.layer
            attn = (layer.q_proj, layer.k_proj, layer.v_proj)
            qkv = torch.cat([m.weight for m in attn])
            qkv_bias = None if layer.q_proj.bias is None else torch.cat([m.bias for m in attn])
            self._qkv = self._matrix(qkv, qkv_bias, bits)
            self._o = self._matrix(layer.o_proj.weight, None, bits)
            self._gate_up = self._matrix(torch.cat([layer.gate_proj.weight, layer.up_proj.weight]), None, bits)
            self._down = self._matrix(layer.down_proj.weight, None, bits)
            self._readout = self._matrix(readout_rows, None, readout_bits)
            self._layer = kernels.register_layer(
                layer.input_layernorm.detach().float(), [self._qkv.handle.id], [self._o.handle.id],
                layer.post_attention_layernorm.detach().float(), [self._gate_up.handle.id], [self._down.handle.id],
                None, None, None, None, 0, 0, False,
            )  # fmt: skip
        self._norm = parts.norm_weight.float().contiguous()
        self._vocab = int(readout_rows.shape[0])
        self._scaling = s.head_dim**-0.5
        # token id -> its float32 embedding row: the drafting vocabulary's, looked up once (~6 ms for 8,192 rows,
        # 19 MB; one lookup through a quantized table costs ~0.07 ms whatever its size), and a bounded memo of others
        ids = parts.draft_vocab.tolist()
        self._vocab_rows: dict[int, torch.Tensor] = dict(zip(ids, parts.embed(parts.draft_vocab).float(), strict=True))
        self._embeddings: dict[int, torch.Tensor] = {}
        self.length = 0
        self._capacity = 0
        self._keys = self._values = self._cos = self._sin = torch.zeros(0)
        self._grow(256)

    def __del__(self) -> None:
        if self._layer >= 0:
            with contextlib.suppress(Exception):  # at interpreter shutdown there is nothing left to free
                self._ops.release(-1, self._layer)

    @staticmethod
    def _matrix(weight: torch.Tensor, bias: torch.Tensor | None, bits: int) -> KernelLinear:
        return KernelLinear.from_blocks(kernel_blocks(weight.detach().float(), bits), bias, activation_bits=8)

    def _grow(self, needed: int) -> None:
        """Room for slots and RoPE positions below ``needed`` (doubling; cached entries kept)."""
        if needed <= self._capacity:
            return
        s = self.shape
        capacity = -(-max(needed, 2 * self._capacity) // _LANES) * _LANES
        keys = torch.zeros((1, s.num_kv_heads, capacity // _LANES, s.head_dim, _LANES), dtype=KERNEL_CACHE_DTYPE)
        values = torch.zeros((1, s.num_kv_heads, capacity, s.head_dim), dtype=KERNEL_CACHE_DTYPE)
        if self._capacity:
            keys[:, :, : self._capacity // _LANES] = self._keys
            values[:, :, : self._capacity] = self._values
        freqs = torch.arange(capacity)[:, None].float() * self.parts.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        scale = self.parts.attention_scaling
        cos, sin = angles.cos() * scale, angles.sin() * scale
        half = s.head_dim // 2
        # rotate_half(x)·sin == swap_halves(x)·[−sin_a, sin_b]: the kernels' table folds the sign in
        self._cos, self._sin = cos.contiguous(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).contiguous()
        self._keys, self._values, self._capacity = keys, values, capacity

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cache entries."""
        self.length = min(self.length, length)

    def _embed(self, ids: list[int]) -> torch.Tensor:
        """Embedding rows [n, H] in float32; a drafting step's few rows from the memo (a table lookup through the
        target's quantized embedding costs more than a head step's matrices)."""
        if len(ids) > _MEMO_ROWS:
            return self.parts.embed(torch.tensor(ids, dtype=torch.int64)).float()
        known = self._vocab_rows
        missing = [t for t in ids if t not in known and t not in self._embeddings]
        if missing:
            if len(self._embeddings) + len(missing) > _MEMO_TOKENS:
                self._embeddings.clear()
            rows = self.parts.embed(torch.tensor(missing, dtype=torch.int64)).float()
            self._embeddings.update(zip(missing, rows, strict=True))
        return torch.stack([known[t] if t in known else self._embeddings[t] for t in ids])

    def step(
        self,
        features: torch.Tensor,
        tokens: list[int],
        positions: list[int],
        tree: TreeRows | None = None,
        read_from: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``TorchHead.step``: rows written at slots ``length..``, features and logits in float32 (no autograd
        graph: the kernels record none)."""
        n = len(tokens)
        start = self.length
        self._grow(max(start + n, max(positions) + 1))
        if tree is None:  # row i sees slots 0..start+i
            meta = [[0, start + i, p, start + i + 1] for i, p in enumerate(positions)]
            offsets = extras = _NO_SLOTS
        else:
            meta = [[0, start + i, p, tree.prefix] for i, p in enumerate(positions)]
            ends = [0]
            for slots in tree.extras:
                ends.append(ends[-1] + len(slots))
            offsets = torch.tensor(ends, dtype=torch.int64)
            extras = torch.tensor([slot for slots in tree.extras for slot in slots], dtype=torch.int64)
        s = self.shape
        out, logits = self._ops.head_step(
            features, self._embed(tokens), self._fc.handle.id, self._layer, self._keys, self._values, self._cos,
            self._sin, torch.tensor(meta, dtype=torch.int32), offsets, extras, s.num_heads, s.num_kv_heads,
            s.head_dim, s.rms_norm_eps, self._scaling, self._norm, self.parts.eps, self._readout.handle.id,
            self._vocab, read_from,
        )  # fmt: skip
        self.length = start + n
        return out, logits
