"""What a model costs in memory on the native runner, and whether it fits the machine.

A ``Footprint`` holds the real bytes: weights read from the memory-mapped file when used (``mapped``: an embedding
table the kernels do not repack) or held in RAM (``repacked``: the kernels' tiles, norms, biases);
per cached token, the KV cache (K and V, every layer: float16 on the compiled kernels) and the runner's position
tables (RoPE cos/sin rows, the slot index); per row of a pass, the decoder's scratch, and the attention partials
per row and chunk of 128 keys. ``file_footprint`` computes it from a GGUF file's index before any weight is read;
``loaded_footprint`` from the tensors a loaded model holds. ``check_fits`` refuses, in one line, a need larger than
``available_memory()`` (MemAvailable, or a cgroup's limit if lower; ``$SPECDECODE_AVAILABLE_MEMORY`` overrides).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelNotAvailable

ATTENTION_CHUNK = 128  # keys per attention partial in kernels/csrc/attention.h (kAttChunk)
VERIFY_ROWS = 9  # rows per request in a verify pass: up to 8 drafted tokens (max_gamma) and the newest one
INITIAL_SLOTS = 1024  # a runner's first KV allocation; it doubles on demand up to the context cap
AVAILABLE_ENV = "SPECDECODE_AVAILABLE_MEMORY"
_CGROUP_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))
_FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}


@dataclass(frozen=True)
class Layout:
    """A matrix's integer blocks as the kernels keep them: ``group`` weights per scale, ``bits`` per weight,
    ``sym`` the zero point of symmetric blocks (-1: asymmetric, with offsets), ``scales`` as ``IntBlocks.scale_format``
    ("f32", "f16", or "superN": int8 per group times float16 per super-block of N groups)."""

    group: int
    bits: int
    sym: int
    scales: str

    @property
    def int8_rows(self) -> bool:
        """Whether the weights are exactly int8 values times a scale (an exact int8 table can be built)."""
        return self.sym >= 0 and self.bits <= 8 and self.sym <= 128


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a GGUF file: its name, ``rows`` × ``cols`` (a vector: 1 × n), its block layout (None: a float
    type, held dense in float32) and its bytes in the file."""

    name: str
    rows: int
    cols: int
    layout: Layout | None
    file_bytes: int


@dataclass(frozen=True)
class Shape:
    """The decoder sizes the runner's caches and scratch depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    ropes: int = 1  # RoPE tables (Gemma 3: a local and a global one)


@dataclass(frozen=True)
class Footprint:
    """A model's memory on the native runner, in bytes (see the module docstring)."""

    mapped: int
    repacked: int
    kv_per_token: int
    tables_per_token: int
    scratch_per_row: int  # the decoder's buffers for one row (float32 activations, int16 inputs)
    logits_per_row: int  # a row whose logits are computed (verify passes; a prefill computes none)
    partials_per_row_chunk: int  # attention partials of one row over one chunk of ATTENTION_CHUNK keys

    def __post_init__(self) -> None:
        negative = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) < 0]
        if negative:
            raise ValueError(f"{negative[0]} must be >= 0 bytes")

    def __add__(self, other: Footprint) -> Footprint:
        """Two models side by side (a target and its draft): every figure summed (their scratch too: an upper bound,
        as their passes take turns)."""
        return Footprint(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    @property
    def weights(self) -> int:
        return self.mapped + self.repacked

    @property
    def per_token(self) -> int:
        """KV cache and position tables per cached token of one sequence."""
        return self.kv_per_token + self.tables_per_token

    def pass_scratch(self, rows: int, keys: int, logit_rows: int = 0) -> int:
        """Scratch of one pass of ``rows`` rows over up to ``keys`` cached keys (``logit_rows`` of them scored)."""
        chunks = math.ceil(keys / ATTENTION_CHUNK)
        return rows * (self.scratch_per_row + chunks * self.partials_per_row_chunk) + logit_rows * self.logits_per_row

    def scratch(self, context: int, batch: int = 1) -> int:
        """The largest pass: a prompt of ``context`` tokens prefilled at once, or a verify pass of ``batch``
        requests (VERIFY_ROWS rows each) at ``context`` keys."""
        verify = batch * VERIFY_ROWS
        return max(self.pass_scratch(context, context), self.pass_scratch(verify, context, verify))

    def cache(self, context: int, batch: int = 1) -> int:
        """KV caches and position tables of ``batch`` sequences of ``context`` tokens."""
        return batch * context * self.per_token

    def total(self, context: int, batch: int = 1) -> int:
        """Weights, caches and scratch for ``batch`` sequences of up to ``context`` tokens."""
        return self.weights + self.cache(context, batch) + self.scratch(context, batch)


def kv_bytes_per_token(shape: Shape, element_bytes: int = 2) -> int:
    """layers · kv_heads · head_dim · 2 (K and V) · bytes per element (float16 on the compiled kernels)."""
    return shape.layers * shape.kv_heads * shape.head_dim * 2 * element_bytes


def footprint(shape: Shape, mapped: int, repacked: int, kv_element: int = 2, table_element: int = 4) -> Footprint:
    """The ``Footprint`` of weights of ``mapped`` + ``repacked`` bytes on a decoder of ``shape`` (KV elements of
    ``kv_element`` bytes; RoPE tables of ``table_element`` bytes, in the residual stream's dtype)."""
    q_width = shape.heads * shape.head_dim
    qkv_width = q_width + 2 * shape.kv_heads * shape.head_dim
    floats = 3 * shape.hidden + 2 * q_width + qkv_width + 3 * shape.intermediate  # x, h, normed, q, attn, qkv, gu, act
    return Footprint(
        mapped=mapped,
        repacked=repacked,
        kv_per_token=kv_bytes_per_token(shape, kv_element),
        tables_per_token=shape.ropes * 2 * shape.head_dim * table_element + 8,
        scratch_per_row=4 * floats + 2 * max(shape.hidden, shape.intermediate, q_width),
        logits_per_row=4 * (shape.vocab + shape.hidden),
        partials_per_row_chunk=4 * shape.heads * (shape.head_dim + 2),
    )


def kernel_matrix_bytes(rows: int, cols: int, layout: Layout, bias: bool = False) -> int:
    """Bytes of ``KernelLinear.from_blocks``: outputs in tiles of 16, 4-bit weights as nibbles, 5-bit ones as nibbles
    and a plane of their fifth bits (5/8 of a byte), 6- to 8-bit ones as bytes, one scale (and offset, if
    asymmetric) per group of ≤ 32 per output (two-level: an int8 per group and a float16 per super-block), a float32
    bias."""
    from .formats.kernel_linear import packed_row_bytes, packing_of

    group = layout.group // max(layout.group // 32, 1)
    padded = math.ceil(rows / 16) * 16
    packed = padded * packed_row_bytes(cols, *packing_of(layout.bits, group))
    groups = padded * (cols // group)
    if layout.scales.startswith("super"):
        scales = groups + groups // int(layout.scales.removeprefix("super")) * 2
    else:
        scales = groups * (2 if layout.scales == "f16" else 4)
    return packed + scales * (1 if layout.sym >= 0 else 2) + (4 * rows if bias else 0)


def weight_bytes(tensors: Sequence[FileTensor]) -> tuple[int, int]:
    """(mapped, repacked) bytes of a GGUF's weights as the native runner on the kernels holds them: decoder
    matrices in the kernels' tiles (q/k/v and gate/up fused when their layouts match); the LM head in tiles (a tied
    one from the embedding's blocks), its exact int8 rows read back from them; the embedding: a tied head's exact
    rows when its blocks are int8 values, else read from the file (mapped); float tensors (norms, biases) dense in
    float32."""
    by_name = {t.name: t for t in tensors}
    mapped = repacked = 0
    groups: dict[tuple[str, str], list[FileTensor]] = {}
    for t in tensors:
        if t.name.endswith(".bias") and t.name.removesuffix(".bias") + ".weight" in by_name:
            continue  # a bias is counted with its matrix
        if t.name.startswith("blk.") and t.layout is not None:
            block, _, rest = t.name.removeprefix("blk.").partition(".")
            kind = rest.removesuffix(".weight")
            groups.setdefault((block, _FUSED.get(kind, kind)), []).append(t)
        elif t.name not in ("token_embd.weight", "output.weight"):
            repacked += 4 * t.rows * t.cols
    for parts in groups.values():
        layouts = {p.layout for p in parts}
        stacked = [FileTensor("", sum(p.rows for p in parts), parts[0].cols, parts[0].layout, 0)]
        for p in parts if len(layouts) > 1 else stacked:
            repacked += kernel_matrix_bytes(p.rows, p.cols, p.layout)
        repacked += sum(4 * p.rows for p in parts if p.name.removesuffix(".weight") + ".bias" in by_name)
    embed = by_name.get("token_embd.weight")
    head = by_name.get("output.weight", embed)
    if embed is not None:
        if embed.layout is None:
            repacked += 4 * embed.rows * embed.cols
        elif embed.layout.int8_rows and head is embed:
            pass  # KernelRows: the head's tiles
        else:
            mapped += embed.file_bytes
    if head is not None:
        if head.layout is None:  # re-quantized to int8 rows (approximately: weights once, exact rows once)
            repacked += 2 * head.rows * head.cols
        else:
            repacked += kernel_matrix_bytes(head.rows, head.cols, head.layout)  # its exact rows: KernelRows
    return mapped, repacked


def _int8_layout(cols: int) -> Layout:
    """``Int8Linear.blocks``' layout: a row's bfloat16 scale (a float16 value) over blocks of 32 (else 16)."""
    return Layout(32 if cols % 32 == 0 else 16, 8, 128, "f16")


def shape_of(model: Any) -> Shape:
    """The decoder sizes of a (skeleton or loaded) transformers model."""
    from .native.architecture import architecture_of

    config = model.config.get_text_config()
    return Shape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=model.model.layers[0].self_attn.head_dim,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        ropes=len(architecture_of(model).ropes),
    )


def file_tensors(path: str | Path) -> list[FileTensor]:
    """The tensors of a GGUF file from its index, each block type's layout read from one row of it."""
    import gguf

    from .gguf.file_blocks import BLOCK_TYPES, FileBlocks
    from .gguf.index import gguf_index

    layouts: dict[str, Layout] = {}
    found = []
    for tensor in gguf_index(path).tensors:
        kind = tensor.tensor_type.name
        data = tensor.data
        rows = data.shape[0] if data.ndim > 1 else 1
        if kind in BLOCK_TYPES:
            if kind not in layouts:
                group, bits, sym, _, scales = FileBlocks(tensor).layout
                layouts[kind] = Layout(group, bits, sym, scales)
            block, size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
            cols = data.shape[-1] // size * block
        else:
            cols = data.shape[-1]
        found.append(FileTensor(tensor.name, rows, cols, layouts.get(kind), data.nbytes))
    return found


def file_footprint(path: str | Path, skeleton: Any) -> Footprint:
    """The footprint of a GGUF file's own blocks on the kernels (``gguf``), from its index and ``skeleton``'s sizes
    and computed buffers (RoPE's inverse frequencies), before any weight is read."""
    mapped, repacked = weight_bytes(file_tensors(path))
    buffers = sum(b.nbytes for b in skeleton.buffers() if not b.is_meta)
    return footprint(shape_of(skeleton), mapped, repacked + buffers)


def dense_footprint(skeleton: Any, element_bytes: float, kv_element: int, table_element: int) -> Footprint:
    """The footprint of a model whose weights take ``element_bytes`` per parameter (dense; a tied head shares the
    embedding's, though a skeleton's may not yet), and its computed buffers (RoPE's inverse frequencies)."""
    from .native.architecture import tied_head

    parameters = sum(p.numel() for p in skeleton.parameters())
    if skeleton.lm_head.weight is not skeleton.model.embed_tokens.weight and tied_head(skeleton):
        parameters -= skeleton.lm_head.weight.numel()
    buffers = sum(b.nbytes for b in skeleton.buffers() if not b.is_meta)
    return footprint(shape_of(skeleton), 0, int(parameters * element_bytes) + buffers, kv_element, table_element)


_FUSED_MODULES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def rounded_footprint(skeleton: Any, kind: str, group_size: int, kernels: bool, embed_element: int) -> Footprint:
    """The footprint of ``int8`` / ``int4`` weights rounded from dense ones (``quantize_model``), from ``skeleton``
    (on the meta device): decoder matrices in the kernels' tiles (q/k/v and gate/up fused; int8 rows with float16
    scales) or, without ``kernels``, PyTorch's packed formats; the LM head as int8 rows (its tiles and its exact int8
    table, one float32 scale a row); the input embedding as the tied head's rows, else ``embed_element`` bytes a
    weight; norms, biases and buffers in float32; a float16 KV cache on the kernels (else float32)."""
    from .native.architecture import FAMILIES, tied_head

    fused = getattr(skeleton.config, "model_type", None) in FAMILIES
    repacked = sum(b.nbytes for b in skeleton.buffers() if not b.is_meta)
    counted: set[int] = set()
    for layer in skeleton.model.layers:
        matrices: dict[str, list[Any]] = {}
        for name, module in layer.named_modules():
            if type(module).__name__ == "Linear":
                key = _FUSED_MODULES.get(name.rpartition(".")[2], name) if fused else name
                matrices.setdefault(key, []).append(module)
        for parts in matrices.values():
            rows, cols = sum(m.out_features for m in parts), parts[0].in_features
            bias = any(m.bias is not None for m in parts)
            if kernels:
                layout = _int8_layout(cols) if kind == "int8" else Layout(group_size, 4, -1, "f32")
                repacked += kernel_matrix_bytes(rows, cols, layout, bias)
            elif kind == "int8":  # int8 rows, a bfloat16 scale each
                repacked += rows * cols + 2 * rows + 4 * rows * bias
            else:  # nibbles, a bfloat16 scale and zero per group
                repacked += rows * cols // 2 + 4 * rows * (cols // group_size) + 4 * rows * bias
            counted.update(id(p) for m in parts for p in m.parameters())
    head, embed = skeleton.lm_head, skeleton.model.embed_tokens
    vocab, hidden = head.out_features, head.in_features
    repacked += vocab * hidden + 4 * vocab  # the head's exact int8 rows
    repacked += kernel_matrix_bytes(vocab, hidden, _int8_layout(hidden)) if kernels else 2 * vocab
    counted.update(id(p) for p in (*head.parameters(), *embed.parameters()))
    if not tied_head(skeleton):
        repacked += embed.weight.numel() * embed_element
    repacked += 4 * sum(p.numel() for p in skeleton.parameters() if id(p) not in counted)
    return footprint(shape_of(skeleton), 0, repacked, 2 if kernels else 4, 4)


def held_weight_bytes(model: Any) -> tuple[int, int]:
    """(mapped, repacked) bytes of the weights a loaded model holds: every tensor of its modules (parameters,
    buffers, weight formats and the fused ones the quantizer registered), each storage counted once; an
    embedding that reads the GGUF file's blocks when used counts as mapped."""
    from .formats.weights import QuantizedEmbedding, fused_of
    from .gguf.file_blocks import FileBlocks

    storages: dict[int, int] = {}
    mapped = 0
    for module in model.modules():
        attributes = [v for k, v in vars(module).items() if not k.startswith("_")]
        held = [*module._parameters.values(), *module._buffers.values(), *attributes, fused_of(module)]
        for tensor in _tensors(held):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        if isinstance(module, QuantizedEmbedding) and isinstance(getattr(module.table, "__self__", None), FileBlocks):
            mapped += module.table.__self__.raw.nbytes
    return mapped, sum(storages.values())


def _tensors(held: Any) -> Iterator[Any]:
    """The tensors inside ``held``: a tensor, a weight format (a dataclass of tensors), or a list of them."""
    import torch

    if isinstance(held, torch.Tensor):
        if not held.is_meta:
            yield held
    elif dataclasses.is_dataclass(held) and not isinstance(held, type):
        for field in dataclasses.fields(held):
            yield from _tensors(getattr(held, field.name))
    elif isinstance(held, list | tuple):
        for item in held:
            yield from _tensors(item)


def loaded_footprint(loaded: Any) -> Footprint:
    """The footprint of a loaded model (``LoadedModel``), from the tensors it holds and the dtypes its runner uses."""
    mapped, repacked = held_weight_bytes(loaded.model)
    kv = loaded.kv_dtype.itemsize
    table = 4 if loaded.quantization is not None else next(loaded.model.parameters()).dtype.itemsize
    return footprint(shape_of(loaded.model), mapped, repacked, kv, table)


def available_memory() -> tuple[int, str] | None:
    """(bytes this process may still allocate, where that figure comes from): ``$SPECDECODE_AVAILABLE_MEMORY``
    if set, else the lower of MemAvailable and the cgroup's limit less its usage; None where neither is known."""
    text = os.environ.get(AVAILABLE_ENV)
    if text:
        return parse_bytes(text, AVAILABLE_ENV), f"${AVAILABLE_ENV}"
    found = []
    meminfo = _read("/proc/meminfo")
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    for limit, usage in _CGROUP_FILES:
        cap, used = _read(f"/sys/fs/cgroup/{limit}"), _read(f"/sys/fs/cgroup/{usage}")
        if cap and used and cap.strip().isdigit() and used.strip().isdigit():
            found.append((max(0, int(cap) - int(used)), "the cgroup's memory limit"))
            break
    return min(found) if found else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str, what: str) -> int:
    """``"123456"``, ``"512M"``, ``"1.5G"`` or ``"2GiB"`` (binary units) as bytes."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _UNITS else ""
    try:
        number = float(value.removesuffix(unit) if unit else value)
    except ValueError:
        raise ValueError(f"{what} must be a size such as 8G, 512M or 123456 bytes, got {text!r}") from None
    if not number >= 0:
        raise ValueError(f"{what} must be >= 0, got {text!r}")
    return int(number * _UNITS[unit])


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: B, KiB, MiB or GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def describe(found: Footprint) -> str:
    """The footprint in a few words: weights (repacked, mapped), cache per token, scratch per row."""
    return (
        f"weights {format_bytes(found.repacked)} in RAM + {format_bytes(found.mapped)} mapped from the file, "
        f"KV cache {format_bytes(found.kv_per_token)}/token (+{format_bytes(found.tables_per_token)} position "
        f"tables), scratch {format_bytes(found.scratch_per_row)}/row"
    )


def check_fits(
    name: str,
    found: Footprint,
    context: int,
    batch: int = 1,
    available: tuple[int, str] | None = None,
    fix: str = "lower --max-context",
) -> None:
    """Refuse (``ModelNotAvailable``, one line) when ``batch`` sequences of ``context`` tokens of ``name`` need more
    than the memory available (``available_memory()`` unless given; nothing is refused where it is unknown)."""
    available = available_memory() if available is None else available
    need = found.total(context, batch)
    if available is None or need <= available[0]:
        return
    free, source = available
    sequences = f"{batch} sequences of {context} tokens" if batch > 1 else f"a sequence of {context} tokens"
    most = _most_tokens(found, batch, free, context)
    if found.weights >= free:
        advice = "the weights alone do not fit: free memory first"
    else:
        advice = f"{fix} (at most {most} tokens fit)" if most else f"{fix} (no length fits {batch} at once)"
    raise ModelNotAvailable(
        f"{name} needs {format_bytes(need)} for {sequences} (weights {format_bytes(found.weights)}, KV cache "
        f"{format_bytes(found.cache(context, batch))}, scratch {format_bytes(found.scratch(context, batch))}) but "
        f"{format_bytes(free)} is available ({source}): {advice}"
    )


def _most_tokens(found: Footprint, batch: int, free: int, context: int) -> int:
    """The longest sequence below ``context`` whose ``batch`` copies fit ``free`` bytes (0: none)."""
    low, high = 0, context - 1
    while low < high:  # the need grows with the context
        middle = (low + high + 1) // 2
        low, high = (middle, high) if found.total(middle, batch) <= free else (low, middle - 1)
    return low
