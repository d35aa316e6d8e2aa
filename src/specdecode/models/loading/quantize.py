"""Put a loaded transformers model's linear layers into a quantized format, in place.

``gguf`` keeps a GGUF file's own integer blocks (``gguf-a8``: the same, with int8 activations); ``int4`` rounds
dense weights groupwise to 4 bits; ``int8`` per output row to 8 bits. With the compiled kernels (``kernels/``)
every block type runs as stored (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) and a tied LM head reads the
embedding's own blocks. Without them PyTorch's weight-only kernels run the 4-bit types (scales rounded to
bfloat16) and int8 rows (Q8_0 re-quantized per row); other types stay dense float32, and the LM head is int8
per row. A tied input embedding reads the file's table (exact) or the head's int8 rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ... import kernels
from ..formats.blocks import CHUNK_BYTES, IntBlocks, StackedBlocks, int8_rows, return_freed_memory
from ..formats.kernel_linear import KernelLinear
from ..formats.weights import (
    GROUP_SIZES,
    FloatRows,
    GroupQuant,
    Int4Linear,
    Int8Groups,
    Int8Linear,
    KernelRows,
    QuantizedEmbedding,
    QuantizedLinear,
    RowSlice,
    concat_biases,
    register_fused,
)
from ..gguf.file_blocks import BLOCK_TYPES, FileBlocks, StoredTensor, read_gguf_tensors
from ..native.architecture import FAMILIES, tied_head

QUANTIZATIONS = ("gguf", "gguf-a8", "int8", "int4")
_LLAMA_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                 ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # fmt: skip


@dataclass(frozen=True)
class Quantization:
    """How to store the weights: ``kind`` in QUANTIZATIONS; ``group_size`` for ``int4`` (GGUF blocks fix their own).

    ``gguf-a8`` keeps the file's blocks as ``gguf`` does and quantizes the activations to int8 instead of int16
    (llama.cpp's numerics: the kernels multiply twice as fast, top-1 agreement with float32 drops a little)."""

    kind: str
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.kind not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {self.kind!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size}")

    @property
    def reads_gguf(self) -> bool:
        return self.kind.startswith("gguf")

    @property
    def activation_bits(self) -> int:
        """The compiled kernels' activation precision."""
        return 8 if self.kind == "gguf-a8" else 16


def quantize_model(
    model: nn.Module,
    quantization: Quantization,
    gguf_path: Path | None = None,
    checkpoint: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, int]:
    """Replace ``model``'s decoder linears, LM head and tied embedding by quantized modules, in place; return how
    many matrices (the LM head included) each stored format has: GGUF type names, or ``int8`` / ``int4/G``.

    With the compiled kernels every integer format runs as ``KernelLinear`` (GGUF blocks of every type kept as
    stored); without them, as PyTorch's int4/int8 weight-only kernels (other GGUF types stay dense float32).
    ``model`` may be a skeleton whose parameters are on the meta device: every parameter then comes from the GGUF
    file (blocks straight into the kernels' layout, only what stays dense dequantized) or, for ``int8`` / ``int4``,
    from ``checkpoint`` (an HF folder's tensors, read one at a time: each matrix is rounded from its own float32
    copy, freed before the next is read; norms and biases in float32; an untied embedding in its stored dtype).
    """
    if quantization.reads_gguf and gguf_path is None:
        raise ValueError(f"quantization={quantization.kind!r} needs a GGUF file: load a .gguf path or a bundled model")
    types: dict[str, str] = {}
    tied = tied_head(model)
    if quantization.reads_gguf:
        stored = read_gguf_tensors(gguf_path, model, types)
        fill_from_file(model, {name: t for name, t in stored.items() if isinstance(t, torch.Tensor)})
    else:
        stored = checkpoint if checkpoint is not None else {}
        _fill_unquantized(model, stored)
    formats: dict[str, int] = {}
    bits = quantization.activation_bits
    native = kernels.ops() is not None
    llama = getattr(model.config, "model_type", None) in FAMILIES  # q/k/v and gate/up fused
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        groups = _LLAMA_GROUPS if llama else tuple((name,) for name, m in layer.named_modules() if _is_linear(m))
        for group in groups:
            modules = [layer.get_submodule(name) for name in group]
            stored_weights = [stored.get(f"{prefix}{name}.weight") for name in group]
            for name in group:
                kind = _format_name(quantization, types.get(f"{prefix}{name}.weight"))
                formats[kind] = formats.get(kind, 0) + 1
            sources = [_source(m, w, quantization, native) for m, w in zip(modules, stored_weights, strict=True)]
            _quantize_group(layer, group, modules, sources, bits)
    formats[f"{_quantize_head(model, stored, types, tied, native, bits)} head"] = 1
    fill_from_file(model, stored)  # what stays dense (a type the kernels do not take, or no kernels)
    embed = model.model.embed_tokens
    if type(embed) is not QuantizedEmbedding and embed.weight.dtype != torch.float32:  # an untied table as stored
        scale = getattr(embed, "embed_scale", None)
        scale = None if scale is None else scale.float()
        model.model.embed_tokens = QuantizedEmbedding(FloatRows(embed.weight.detach()), embed.num_embeddings,
                                                      embed.embedding_dim, scale)  # fmt: skip
    return formats


def _fill_unquantized(model: nn.Module, checkpoint: Mapping[str, torch.Tensor]) -> None:
    """Give a skeleton's parameters that stay dense their ``checkpoint`` tensors before its matrices are rounded:
    norms and biases in float32 (the residual stream's dtype), the input embedding in its stored dtype."""
    if not checkpoint:
        return
    embed = "model.embed_tokens.weight"
    matrices = {f"{name}.weight" for name, m in model.named_modules() if _is_linear(m)} | {embed}
    small = [n for n, p in model.named_parameters() if p.is_meta and n not in matrices and n in checkpoint]
    fill_from_file(model, {name: checkpoint[name] for name in small})
    fill_from_file(model, {embed: checkpoint[embed]} if embed in checkpoint else {}, None)


@torch.no_grad()
def fill_from_file(
    model: nn.Module, stored: Mapping[str, StoredTensor], dtype: torch.dtype | None = torch.float32
) -> None:
    """Give every parameter still on the meta device its tensor from the file (block types dequantized as
    transformers' loader dequantizes them), in ``dtype`` (None: as stored); a tied head shares the embedding's.
    ``stored`` may read each tensor when asked (``checkpoint.Checkpoint``): one is held at a time."""
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if not param.is_meta or name not in stored:
            continue
        value = stored[name]
        value = value.dense() if isinstance(value, IntBlocks | FileBlocks) else value
        module_name, _, attribute = name.rpartition(".")
        value = value if dtype is None else value.to(dtype)
        setattr(model.get_submodule(module_name), attribute, nn.Parameter(value, requires_grad=False))
    head, embed = model.lm_head, model.model.embed_tokens
    if isinstance(head, nn.Linear) and head.weight.is_meta and tied_head(model) and not embed.weight.is_meta:
        head.weight = embed.weight


def _format_name(quantization: Quantization, gguf_type: str | None) -> str:
    """A matrix's stored format as ``quantize_model`` reports it."""
    if quantization.kind == "int4":
        return f"int4/{quantization.group_size}"
    if quantization.kind == "int8":
        return "int8"
    return gguf_type if gguf_type in BLOCK_TYPES else f"dense ({gguf_type or 'not in the file'})"


def _is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


Source = IntBlocks | FileBlocks | GroupQuant | Int8Linear | None  # IntBlocks: in memory (tests, int4/int8)


def _source(module: nn.Module, stored, quantization: Quantization, native: bool) -> Source:
    """What ``module`` becomes: integer blocks for the kernels (``native``), else 4-bit groups or int8 rows for
    PyTorch's kernels, or None (stays dense). ``stored``: the file's blocks, or (a skeleton's module) its weights."""
    bias = module.bias
    weight = stored if module.weight.is_meta and isinstance(stored, torch.Tensor) else module.weight
    if quantization.kind == "int4":
        groups = _rounded(weight, None, quantization)
        return groups.blocks() if native else groups
    if quantization.kind == "int8":
        rows = _rounded(weight, bias, quantization)
        return rows.blocks() if native else rows
    if not isinstance(stored, IntBlocks | FileBlocks):
        return None
    if native:
        return stored
    blocks = stored.blocks()
    if blocks.bits <= 4:
        return GroupQuant.from_blocks(blocks)
    if blocks.bits == 8 and blocks.sym == 128:  # Q8_0: re-quantized per row for the int8 kernel
        return Int8Linear.quantize(blocks.dequantize(), bias)
    return None


def _rounded(weight: torch.Tensor, bias: torch.Tensor | None, quantization: Quantization) -> GroupQuant | Int8Linear:
    """``weight`` as int4 groups or int8 rows, rounded ~``CHUNK_BYTES / 4`` of float32 rows at a time (their temporaries
    handed back to the system after each): every row is rounded on its own, so the result is bitwise the whole
    matrix's, without a float32 copy of it."""
    step = max(16, CHUNK_BYTES // 16 // weight.shape[1])
    parts = []
    for start in range(0, weight.shape[0], step):
        part = weight[start : start + step]
        kind = quantization.kind
        parts.append(
            GroupQuant.quantize(part, quantization.group_size) if kind == "int4" else Int8Linear.quantize(part)
        )
        return_freed_memory()
    if quantization.kind == "int4":
        return GroupQuant.cat(parts)
    bias = None if bias is None else bias.detach().float()
    return Int8Linear(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), bias)


def _int8_blocks(rows: Int8Linear) -> StackedBlocks:
    """``rows.blocks()`` made a slice of rows at a time (its int16 temporaries slice-sized: a
    vocabulary-sized head's were 4 bytes a weight), the same blocks."""
    step = max(16, CHUNK_BYTES // rows.q.shape[1] // 16 * 16)
    parts = [Int8Linear(rows.q[start : start + step], rows.scale[start : start + step]).blocks()
             for start in range(0, rows.q.shape[0], step)]  # fmt: skip
    half = all(part.half_scales for part in parts)  # float16 scales only where every slice's are exactly so
    return StackedBlocks(tuple(dataclasses.replace(part, half_scales=half) for part in parts))


def _quantize_group(layer: nn.Module, names, modules, sources, activation_bits: int = 16) -> None:
    """Swap the modules of one fusable group; register their fused format for the native runner."""
    fused: KernelLinear | Int4Linear | Int8Linear | None = None
    if all(isinstance(s, IntBlocks | FileBlocks) for s in sources):
        fused = KernelLinear.cat(sources, concat_biases(modules), activation_bits)  # None when layouts differ
    elif all(isinstance(s, GroupQuant) for s in sources):
        fused = Int4Linear.from_groups(GroupQuant.cat(sources), concat_biases(modules))
    elif all(isinstance(s, Int8Linear) for s in sources):
        q, scale = torch.cat([s.q for s in sources]), torch.cat([s.scale for s in sources])
        fused = Int8Linear(q, scale, concat_biases(modules))
    if fused is not None:
        if len(modules) == 1:
            kernels_ = [fused]
        else:
            bounds = torch.tensor([0] + [m.out_features for m in modules]).cumsum(0).tolist()
            kernels_ = [RowSlice(fused, a, b) for a, b in itertools.pairwise(bounds)]
    else:  # mixed or dense: each part on its own (the native runner concatenates their outputs)
        kernels_ = [_format(s, m, activation_bits) for s, m in zip(sources, modules, strict=True)]
    swapped = []
    for name, module, kernel in zip(names, modules, kernels_, strict=True):
        if kernel is None:
            swapped.append(module)
            continue
        new = QuantizedLinear(kernel, module.in_features, module.out_features)
        layer.set_submodule(name, new)
        swapped.append(new)
    if fused is not None and len(swapped) > 1:
        register_fused(swapped, fused)


def _format(source: Source, module: nn.Module, activation_bits: int) -> KernelLinear | Int4Linear | Int8Linear | None:
    if isinstance(source, IntBlocks | FileBlocks):
        return KernelLinear.from_blocks(source, module.bias, activation_bits)
    if isinstance(source, GroupQuant):
        return Int4Linear.from_groups(source, module.bias)
    return source


def _quantize_head(
    model: nn.Module, stored: dict[str, StoredTensor], types: dict[str, str], tied: bool, native: bool,
    activation_bits: int = 16,
) -> str:  # fmt: skip
    """LM head → its own blocks from the file when the kernels run (the embedding's when tied), else int8 per row;
    return the format it runs. A head whose weights are int8 times a scale (Q8_0, Q6_K, ...) carries its exact
    int8 rows, from which the runner recomputes each row's top logits (an int8 head carries its own): on the kernels
    they are read back from the head's own tiles (``KernelRows``: no second vocabulary-sized table, ~100 MB at 1.7B,
    ~500 MB at 8B), else they are an int8 table. The input embedding is a tied head's exact rows, else reads the
    file's blocks a row at a time (exact), else (no blocks) the tied head's int8 rows."""
    head = model.lm_head
    embed = model.model.embed_tokens
    embed_blocks = _blocks_of(stored, "model.embed_tokens.weight")
    head_blocks = embed_blocks if tied else _blocks_of(stored, "lm_head.weight")
    embed_table = None
    if native and head_blocks is not None:
        kernel = KernelLinear.from_blocks(head_blocks, head.bias, activation_bits)
        exact = KernelRows(kernel) if int8_rows(head_blocks) else None
        embed_table = exact if tied else None
        name = types["model.embed_tokens.weight" if tied else "lm_head.weight"]
    elif head_blocks is not None and int8_rows(head_blocks) and head_blocks.layout[1] == 8:  # no kernels: Q8_0
        exact = _int8_table(head_blocks)
        embed_table = exact if tied else _int8_table(embed_blocks)
        kernel = Int8Linear.quantize(exact.dequantize(), head.bias)
        name = types["model.embed_tokens.weight" if tied else "lm_head.weight"]
    else:
        embed_table = None if native else _int8_table(embed_blocks)
        fill_from_file(model, {k: stored[k] for k in ("lm_head.weight",) if k in stored}, None)  # rounded by slices
        rows = _rounded(head.weight, head.bias, Quantization("int8"))
        exact = rows.exact_rows()
        kernel = KernelLinear.from_blocks(_int8_blocks(rows), head.bias, activation_bits) if native else rows
        name = "int8"
    model.lm_head = QuantizedLinear(kernel, head.in_features, head.out_features, exact_rows=exact)
    table = embed_table
    if table is None and embed_blocks is not None:
        table = embed_blocks.dense_rows
    elif table is None and tied:
        table = exact
    if table is not None:
        scale = getattr(embed, "embed_scale", None)  # Gemma's sqrt(hidden), in the rows' dtype (float32)
        scale = None if scale is None else scale.float()
        model.model.embed_tokens = QuantizedEmbedding(table, embed.num_embeddings, embed.embedding_dim, scale)
    return name


def _blocks_of(stored: dict[str, StoredTensor], name: str) -> IntBlocks | FileBlocks | None:
    found = stored.get(name)
    return found if isinstance(found, IntBlocks | FileBlocks) else None


def _int8_table(blocks: IntBlocks | FileBlocks | None) -> Int8Groups | None:
    """The blocks as an exact int8 table, when their weights are int8 values times a scale."""
    return Int8Groups.from_blocks(blocks) if blocks is not None and int8_rows(blocks) else None
