"""Weight formats of a linear layer: dense, int4 groupwise and int8 per-channel, each a callable ``x -> x @ W.T``.

A format is a property of the weights, not of the runner: the native runner and transformers' modules
(through ``QuantizedLinear``) call the same objects. The quantized formats run PyTorch's weight-only CPU
kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) on bfloat16 activations, their fast path;
both are row-invariant (each row of a k-row product is bitwise the one-row product), which the tests check.
A GGUF file's integer blocks are ``blocks``'; on the compiled kernels they run as ``kernel_linear``'s
``KernelLinear``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import BlockSource, IntBlocks, int8_rows, row_chunks
from .kernel_linear import KernelLinear

ACTIVATION_DTYPE = torch.bfloat16  # what the weight-only kernels are fast for
GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class GroupQuant:
    """Groupwise asymmetric 4-bit weights: w[n, j] = (q[n, j] − 8)·scale[n, g] + zero[n, g], g = j // group_size."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K / group_size]
    zero: torch.Tensor  # float32 [N, K / group_size]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group_size, self.group_size) - 8
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    @staticmethod
    def quantize(weight: torch.Tensor, group_size: int) -> GroupQuant:
        """Round each group of ``group_size`` weights onto 16 levels spanning its min..max."""
        n, k = weight.shape
        if group_size not in GROUP_SIZES or k % group_size:
            raise ValueError(f"group size must be one of {GROUP_SIZES} and divide {k}, got {group_size}")
        groups = weight.detach().float().view(n, k // group_size, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        # Round scale and zero to what the kernel will use first, then pick each q against those.
        scale = _kernel_round(((high - low) / 15).clamp_min(torch.finfo(ACTIVATION_DTYPE).tiny))
        zero = _kernel_round(low + 8 * scale)
        q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.uint8).view(n, k)
        return GroupQuant(q, scale, zero, group_size)

    def blocks(self) -> IntBlocks:
        """The same weights as 4-bit blocks with offsets (w = scale·u + offset), for the compiled kernels."""
        return IntBlocks(self.q, self.scale, self.zero - 8 * self.scale, -1, self.group_size, 4)

    @staticmethod
    def from_blocks(blocks: IntBlocks) -> GroupQuant:
        """4-bit blocks (``IntBlocks``) as ``GroupQuant`` (w = (q − 8)·scale + zero) for the pure-torch kernels."""
        if blocks.bits > 4:
            raise ValueError(f"{blocks.bits}-bit blocks do not fit GroupQuant's 4 bits")
        zero = blocks.offset + 8 * blocks.scale if blocks.offset is not None else (8 - blocks.sym) * blocks.scale
        return GroupQuant(blocks.u, blocks.scale, zero, blocks.group_size)

    @staticmethod
    def cat(parts: Sequence[GroupQuant]) -> GroupQuant:
        """Stack output rows of several matrices with the same input size and group size."""
        return GroupQuant(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            parts[0].group_size,
        )


BF16_ROWS_PER_CALL = 32  # bfloat16 F.linear is row-invariant from 2 to 32 rows on every CPU measured (AMX: not past)


def _bf16_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` on 1..``BF16_ROWS_PER_CALL`` rows, a single row as a pair (its own path differs)."""
    return F.linear(x.expand(2, -1), weight)[:1] if x.shape[0] == 1 else F.linear(x, weight)


@dataclass(frozen=True)
class DenseLinear:
    """Dense weights in the model dtype, computed so that each row's result never depends on the row count.

    float32 GEMMs round a row differently for every row count, so each row is its own ``torch.mv`` (a k-row
    call reads the weights k times: the price of bitwise identity). bfloat16 ``F.linear`` is row-invariant from
    2 to 32 rows but takes another path for 1 row, and on a CPU with AMX (oneDNN's tiles) another from 33 rows
    up (measured on an Intel Xeon, family 6 model 207), so rows go in calls of ``BF16_ROWS_PER_CALL`` at most
    and a single row is computed as a pair.
    """

    weight: torch.Tensor  # [N, K]
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        x = x.to(self.weight.dtype)  # a mixed file's activations may arrive in another format's dtype (int4: bfloat16)
        if self.weight.dtype == torch.float32:
            y = torch.stack([torch.mv(self.weight, row) for row in x])
        elif rows:
            y = torch.cat([_bf16_rows(part, self.weight) for part in x.split(BF16_ROWS_PER_CALL)])
        else:
            y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Int4Linear:
    """4-bit groupwise weights in torch's packed CPU layout; bfloat16 in and out (bias added in float32)."""

    packed: torch.Tensor  # uint8 [N, K / 2], rows in blocks of 64
    scales_zeros: torch.Tensor  # bfloat16 [K / group_size, N, 2]
    group_size: int
    bias: torch.Tensor | None = None

    @staticmethod
    def from_groups(weights: GroupQuant, bias: torch.Tensor | None = None) -> Int4Linear:
        n = weights.q.shape[0]
        if n % 16:
            raise ValueError(f"int4 weights need a multiple of 16 output rows, got {n}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.q.to(torch.int32), 1)
        scales_zeros = torch.stack([weights.scale.t(), weights.zero.t()], dim=-1).to(ACTIVATION_DTYPE).contiguous()
        return Int4Linear(packed, scales_zeros, weights.group_size, _float(bias))

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(ACTIVATION_DTYPE), self.packed, self.group_size, self.scales_zeros
        )
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Int8Linear:
    """8-bit weights with one scale per output row (symmetric); bfloat16 in and out."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # bfloat16 [N]
    bias: torch.Tensor | None = None

    @staticmethod
    def quantize(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """w ≈ scale[n]·q[n, j], q = round(w / scale) with scale = max|w[n]| / 127."""
        w = weight.detach().float()
        largest = w.abs().amax(-1)
        scale = (largest / 127).clamp_min(torch.finfo(ACTIVATION_DTYPE).tiny).to(ACTIVATION_DTYPE)
        # The kernel's bfloat16 scale may round down: step it up so that 127 steps still reach the largest weight.
        scale = torch.where(scale.float() * 127 < largest, torch.nextafter(scale, scale.new_tensor(torch.inf)), scale)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return Int8Linear(q, scale, _float(bias))

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.q.shape[0]))

    def blocks(self) -> IntBlocks:
        """Int8 rows with one scale per row, as 8-bit blocks of 32 (16 where 32 does not divide a row) sharing their
        row's scale, for the compiled kernels."""
        n, k = self.q.shape
        group = 32 if k % 32 == 0 else 16
        scale = self.scale.float()[:, None].expand(n, k // group).contiguous()
        half = bool(torch.equal(scale.half().float(), scale))
        u = self.q.view(torch.uint8) ^ 0x80  # q + 128 for every int8 q, without int16 temporaries
        return IntBlocks(u, scale, None, 128, group, 8, half)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weights of output rows ``index`` as the kernel sees them, in float32."""
        return self.q[index].float() * self.scale[index].float()[..., None]

    def exact_rows(self) -> Int8Groups:
        """The same weights as an int8 table (one scale per row), sharing ``q``."""
        return Int8Groups(self.q, self.scale.float()[:, None])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(ACTIVATION_DTYPE), self.q, self.scale)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class ConcatLinear:
    """Several formats side by side (outputs concatenated): the fusion of parts that cannot share one matrix."""

    parts: tuple[Linear, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


@dataclass(frozen=True)
class RowSlice:
    """Output rows ``start:stop`` of a fused matrix, computed through it: a module's view of a fused format that
    costs no memory (the native runner calls the fused matrix itself; transformers' forward calls this)."""

    fused: Int4Linear | Int8Linear | KernelLinear
    start: int
    stop: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[:, self.start : self.stop]


def kernel_parts(linear: Linear) -> list[int] | None:
    """The kernel matrices computing ``linear`` side by side, or None if any part is another format."""
    if isinstance(linear, KernelLinear):
        return [linear.handle.id]
    if isinstance(linear, ConcatLinear) and all(isinstance(p, KernelLinear) for p in linear.parts):
        return [p.handle.id for p in linear.parts]
    return None


Linear = DenseLinear | Int4Linear | Int8Linear | KernelLinear | ConcatLinear | RowSlice


@dataclass(frozen=True)
class Int8Groups:
    """Int8 rows with one scale per block (GGUF's Q8_0: blocks of 32; a per-row format: one block per row):
    w[n, j] = scale[n, j // block]·q[n, j], exact in float32.

    Called with token ids it is an embedding table that dequantizes only the rows it reads.
    """

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / block]

    def dequantize(self) -> torch.Tensor:
        return self(torch.arange(self.q.shape[0]))

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        q = self.q[tokens].float()
        return (q.view(*q.shape[:-1], self.scale.shape[-1], -1) * self.scale[tokens][..., None]).view(q.shape)

    @staticmethod
    def from_blocks(blocks: BlockSource) -> Int8Groups:
        """Symmetric blocks of up to 8 bits (Q8_0: u = q + 128; Q6_K: u = q + 32, ...) as int8 q = u − sym, read a
        slice of rows at a time."""
        if not int8_rows(blocks):
            raise ValueError("only symmetric blocks of up to 8 bits are int8 rows")
        n, k = blocks.shape
        group, sym = blocks.layout[0], blocks.layout[2]
        q, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // group)
        for start, stop in row_chunks(n, k):
            part = blocks.rows(start, stop)
            q[start:stop] = (part.u.to(torch.int16) - sym).to(torch.int8)
            scale[start:stop] = part.scale
        return Int8Groups(q, scale)


@dataclass(frozen=True)
class KernelRows:
    """The exact rows of a symmetric ``KernelLinear`` (w = scale·q, q int8), read back from its tile layout: a tied
    head's embedding table and exact rows without a second vocabulary-sized copy. Called with token ids (any
    shape): float32 rows, bitwise what ``Int8Groups`` of the same blocks gives."""

    matrix: KernelLinear

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        handle = self.matrix.handle
        q, scale = handle.kernels.matrix_rows(handle.id, tokens.reshape(-1))
        rows = Int8Groups(q, scale)(torch.arange(q.shape[0]))
        return rows.view(*tokens.shape, self.matrix.in_features)

    def dequantize(self) -> torch.Tensor:
        return self(torch.arange(self.matrix.out_features))


@dataclass(frozen=True)
class DenseEmbedding:
    weight: torch.Tensor

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


@dataclass(frozen=True)
class FloatRows:
    """A dense table kept in its stored dtype (bfloat16, float16), rows read out in float32 (exact)."""

    weight: torch.Tensor

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight).float()


Embedding = Callable[[torch.Tensor], torch.Tensor]  # token ids -> float rows: DenseEmbedding, Int8Groups, ...


class QuantizedEmbedding(nn.Module):
    """An ``nn.Embedding`` replacement over a quantized table (float32 rows out), times ``embed_scale`` when the
    embedding it replaces scaled its rows (Gemma)."""

    def __init__(
        self, table: Embedding, num_embeddings: int, embedding_dim: int, embed_scale: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table(ids)
        return rows if self.embed_scale is None else rows * self.embed_scale


def embedding_of(module: nn.Module) -> Embedding:
    """The table behind an ``nn.Embedding`` or a ``QuantizedEmbedding``."""
    if isinstance(module, QuantizedEmbedding):
        return module.table
    return DenseEmbedding(module.weight.detach())


def _kernel_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the kernels' scale dtype, kept as float32."""
    return x.to(ACTIVATION_DTYPE).float()


def _float(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float()


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` replacement that runs a quantized format, so transformers' own forward uses it too."""

    def __init__(
        self,
        kernel: Int4Linear | Int8Linear | KernelLinear | RowSlice,
        in_features: int,
        out_features: int,
        exact_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_features = in_features
        self.out_features = out_features
        # An LM head may carry its weights' exact rows (float32 by token id): the native runner recomputes
        # the few highest logits of each row from them (see NativeRunner).
        self.exact_rows = exact_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x.reshape(-1, self.in_features))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {type(self.kernel).__name__}"


def linear_of(module: nn.Module) -> Linear:
    """The format object behind a dense ``nn.Linear`` or a ``QuantizedLinear``."""
    if isinstance(module, QuantizedLinear):
        return module.kernel
    bias = None if module.bias is None else module.bias.detach()
    return DenseLinear(module.weight.detach(), bias)


# Fused formats registered by the quantizer, keyed by the first module of the group (q_proj, gate_proj).
_FUSED: weakref.WeakKeyDictionary[nn.Module, Linear] = weakref.WeakKeyDictionary()


def register_fused(modules: Sequence[nn.Module], fused: Linear) -> None:
    """Record that ``fused`` computes ``modules`` side by side (their outputs concatenated)."""
    _FUSED[modules[0]] = fused


def concat_biases(modules: Sequence[nn.Module]) -> torch.Tensor | None:
    """The biases of side-by-side linears as one vector (zeros where a module has none), or None if none has."""
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])


def fused_of(module: nn.Module) -> Linear | None:
    """The fused format registered for the group that ``module`` leads, if any."""
    return _FUSED.get(module)


def fuse_linears(modules: Sequence[nn.Module]) -> Linear:
    """One format computing ``modules`` side by side (same input).

    Dense weights are concatenated once and each module's weight becomes a view of the result (no extra
    memory); quantized modules use the fused matrix the quantizer registered; anything else runs part by part.
    """
    if all(type(m) is nn.Linear for m in modules):
        fused = torch.cat([m.weight.detach() for m in modules])
        start = 0
        for m in modules:
            m.weight.data = fused[start : start + m.out_features]
            start += m.out_features
        return DenseLinear(fused, concat_biases(modules))
    registered = fused_of(modules[0])
    if registered is not None:
        return registered
    return ConcatLinear(tuple(linear_of(m) for m in modules))
