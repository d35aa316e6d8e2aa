"""The compiled CPU kernels (kernels/): built here, exact to their maths, row-invariant, the same bits on
every instruction set, and one OpenMP runtime (torch's)."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.kernels import kernels_or_skip, mutant_build, needs_kernels
from helpers.models import tiny_llama

import specdecode as sd
from specdecode import kernels
from specdecode.models.formats.blocks import IntBlocks
from specdecode.models.formats.kernel_linear import KernelLinear, _tile_layout
from specdecode.models.formats.weights import GroupQuant, Int8Linear
from specdecode.models.gguf.file_blocks import (
    decode_q4_0,
    decode_q4_1,
    decode_q4_k,
    decode_q5_0,
    decode_q5_1,
    decode_q5_k,
    decode_q6_k,
    decode_q8_0,
)

pytestmark = needs_kernels

# decoder, bytes per block, offsets of the f16 fields, weights per block
BLOCK_TYPES = {
    "Q4_0": (decode_q4_0, 18, (0,), 32),
    "Q4_1": (decode_q4_1, 20, (0, 2), 32),
    "Q5_0": (decode_q5_0, 22, (0,), 32),
    "Q5_1": (decode_q5_1, 24, (0, 2), 32),
    "Q4_K": (decode_q4_k, 144, (0, 2), 256),
    "Q5_K": (decode_q5_k, 176, (0, 2), 256),
    "Q6_K": (decode_q6_k, 210, (208,), 256),
    "Q8_0": (decode_q8_0, 34, (0,), 32),
}


def random_raw(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """Random GGUF block rows of ``kind`` for a [rows, cols] matrix (f16 fields uniform in ±scale), as stored."""
    _, size, halves, per_block = BLOCK_TYPES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per_block, size), dtype=np.uint8)
    for at in halves:
        fields = rng.uniform(-scale, scale, size=(rows, cols // per_block, 1)).astype(np.float16)
        raw[..., at : at + 2] = fields.view(np.uint8)
    return raw.reshape(rows, -1)


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> IntBlocks:
    """Random GGUF blocks of ``kind`` for a [rows, cols] matrix, decoded (``IntBlocks``)."""
    return BLOCK_TYPES[kind][0](random_raw(kind, rows, cols, seed, scale))


def quantized_reference(x: torch.Tensor, blocks: IntBlocks, bits: int = 16) -> torch.Tensor:
    """x̂ @ W.T in float64: each row quantized per group to ``bits`` (d = max|x| / (2^(bits−1) − 1)) as the
    kernels do it."""
    g = 32 if blocks.group_size > 32 else blocks.group_size
    top = 2 ** (bits - 1) - 1.0
    groups = x.float().view(x.shape[0], -1, g)
    largest = groups.abs().amax(-1, keepdim=True)
    q = torch.round(groups * (top / largest)).clamp(-top, top)
    xhat = (q.double() * (largest / top).double()).view(x.shape)
    return xhat @ blocks.dequantize().double().T


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_linear_computes_the_quantized_product_of_the_files_blocks(kind, bits):
    blocks = random_blocks(kind, 72, 512)
    linear = KernelLinear.from_blocks(blocks, activation_bits=bits)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    expected = quantized_reference(x, blocks, bits)
    got = linear(x).double()
    assert (got - expected).norm() / expected.norm() < 1e-5  # float32 sums, nothing else
    # the control: the other activation precision is measurably another product
    other = quantized_reference(x, blocks, 24 - bits)
    assert (other - expected).norm() / expected.norm() > 1e-4 if bits == 8 else 1e-6


class _MappedTensor:
    """What ``FileBlocks`` reads of a GGUF file's tensor (gguf_index.IndexedTensor), over raw rows in memory."""

    def __init__(self, kind: str, raw: np.ndarray) -> None:
        import gguf

        self.data, self.tensor_type, self.dropped = raw, gguf.GGMLQuantizationType[kind], []

    def drop_pages(self, start: int = 0, stop: int | None = None) -> None:
        self.dropped.append((start, stop))


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_the_compiled_repacker_lays_out_the_files_blocks_as_the_decoders_do(kind, bits):
    """The loader's fast path (the file's blocks decoded and tiled in C++) gives every buffer of the matrix bitwise
    as the numpy decoders + _tile_layout do: one part and stacked parts whose seams fall inside a tile (40 + 24
    rows), in file order and permuted (Llama's q/k), both activation layouts. The control: a part's rows in
    another order give other tiles."""
    from specdecode.models.formats.blocks import StackedBlocks
    from specdecode.models.gguf.file_blocks import FileBlocks

    fields = ("packed", "scales", "offsets", "supers", "super_offsets")
    raws = [random_raw(kind, 40, 512, seed=20), random_raw(kind, 24, 512, seed=21)]
    order = torch.randperm(40, generator=torch.Generator().manual_seed(22))
    one = [FileBlocks(_MappedTensor(kind, raws[0]))]
    two = [FileBlocks(_MappedTensor(kind, raws[0]), order), FileBlocks(_MappedTensor(kind, raws[1]))]
    for files in (one, two):
        stacked = StackedBlocks(tuple(files))
        fast = KernelLinear.from_blocks(stacked if len(files) > 1 else files[0], activation_bits=bits)
        decoded = IntBlocks.cat([f.blocks() for f in files])
        slow = KernelLinear.from_blocks(decoded, activation_bits=bits)
        for name in fields:
            a, b = getattr(fast, name), getattr(slow, name)
            assert (a is None and b is None) or torch.equal(a, b), (name, len(files))
        assert all(f.tensor.dropped for f in files)  # the pages were let go
    shuffled = FileBlocks(_MappedTensor(kind, raws[0]), order)
    in_order = KernelLinear.from_blocks(BLOCK_TYPES[kind][0](raws[0]), activation_bits=bits)
    assert not torch.equal(KernelLinear.from_blocks(shuffled, activation_bits=bits).packed, in_order.packed)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_two_level_scales_give_the_one_level_bits(kind, bits):
    """K-quants keep their scales as the file does (int8 per group × f16 per super-block, a quarter of the bytes);
    the kernels' products d·sc are exact, so every output is bitwise the float32-scales matrix's. 3 super-blocks
    per row and a partial last tile: a wrong super-block index or a lost offset factor changes the bits."""
    blocks = random_blocks(kind, 40, 768, seed=12)
    assert blocks.factors is not None
    two_level = KernelLinear.from_blocks(blocks, activation_bits=bits)
    assert two_level.scales.dtype == torch.int8 and two_level.supers.dtype == torch.float16
    one_level = KernelLinear.from_blocks(dataclasses.replace(blocks, factors=None), activation_bits=bits)
    assert one_level.scales.dtype == torch.float32 and one_level.supers is None
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(13))
    assert torch.equal(two_level(x), one_level(x))
    # the control: one super-block factor of one output changed (to another f16 value) moves that output only
    d = blocks.factors.d.clone()
    d[3, 1] = -d[3, 1] if d[3, 1] != 0 else 1.0
    changed = KernelLinear.from_blocks(
        dataclasses.replace(blocks, factors=dataclasses.replace(blocks.factors, d=d)), activation_bits=bits
    )(x)
    moved = (changed != one_level(x)).any(0)
    assert moved[3] and moved.sum() == 1


@pytest.mark.parametrize(
    ("kind", "bias", "bits"),
    [("Q4_1", False, 16), ("Q8_0", True, 16), ("Q6_K", False, 16), ("Q5_K", True, 16), ("Q4_1", False, 8),
     ("Q6_K", True, 8), ("Q8_0", False, 8), ("Q5_0", False, 16), ("Q5_1", True, 8), ("Q5_K", False, 8)],
)  # fmt: skip
def test_every_row_is_bitwise_the_one_row_product(kind, bias, bits):
    blocks = random_blocks(kind, 40, 256, seed=2)  # 40 outputs: a partial last tile
    b = torch.randn(40) if bias else None
    linear = KernelLinear.from_blocks(blocks, b, bits)
    x = torch.randn(41, 256, generator=torch.Generator().manual_seed(3))
    together = linear(x)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 41):
        assert torch.equal(linear(x[:m]), together[:m]), m
    for row in range(41):
        assert torch.equal(linear(x[row : row + 1])[0], together[row]), row


def test_dense_formats_map_onto_the_kernels():
    """int4 groups (64 wide: split into 32s) and int8 rows compute their own dequantized weights."""
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(4))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    for blocks in (
        GroupQuant.quantize(weight, 64).blocks(),
        Int8Linear.quantize(weight).blocks(),
    ):
        expected = quantized_reference(x, blocks)
        got = KernelLinear.from_blocks(blocks)(x).double()
        assert (got - expected).norm() / expected.norm() < 1e-5


def _register(ops, linear: KernelLinear, packed: torch.Tensor, n: int, k: int):
    """``linear``'s matrix with the tiles ``packed`` registered with the build ``ops`` (released with the handle)."""
    from specdecode.models.formats.kernel_linear import KernelHandle

    per = 1 if linear.supers is None else linear.scales.numel() // linear.supers.numel()
    matrix = ops.register_matrix(packed, linear.scales, linear.offsets, None, n, k, linear.group_size, linear.nibbles,
                                 linear.sym, linear.activation_bits, linear.supers, linear.super_offsets, per,
                                 linear.high_bits)  # fmt: skip
    return KernelHandle(ops, matrix)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K"])
def test_five_bit_blocks_in_nibbles_and_high_bits_give_the_one_byte_layouts_bits(kind, bits, monkeypatch):
    """5-bit blocks held in 5/8 of a byte per weight (the nibbles of u & 15 and a plane of fifth bits, weights.h)
    compute bitwise what the same integers held one byte per weight compute (the earlier format), for 1 to 9 rows and
    a partial last tile, repacked from the file's blocks or laid out from decoded ones. The control: one fifth bit
    flipped in the plane (tile 0, group 0, bit 0: output 0's first low nibble) moves output 0 and no other."""
    from specdecode.models.formats import kernel_linear
    from specdecode.models.gguf.file_blocks import FileBlocks

    raw = random_raw(kind, 40, 512, seed=40)
    planes = KernelLinear.from_blocks(FileBlocks(_MappedTensor(kind, raw)), activation_bits=bits)
    decoded = KernelLinear.from_blocks(BLOCK_TYPES[kind][0](raw), activation_bits=bits)
    monkeypatch.setattr(kernel_linear, "HIGH_BIT_PLANES", False)
    as_bytes = KernelLinear.from_blocks(FileBlocks(_MappedTensor(kind, raw)), activation_bits=bits)
    assert planes.high_bits and planes.nibbles and not as_bytes.high_bits and not as_bytes.nibbles
    assert planes.packed.numel() * 8 == as_bytes.packed.numel() * 5 == 48 * 512 * 5
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(41))
    for m in (1, 2, 3, 4, 5, 8, 9):
        assert torch.equal(planes(x[:m]), as_bytes(x[:m])), m
    assert torch.equal(decoded(x), as_bytes(x))
    flipped = planes.packed.clone()
    flipped[32 * 8] ^= 1  # the first byte of tile 0's group 0 plane, after its 32·8 nibble bytes
    ops = kernels.ops("native")
    handle = _register(ops, planes, flipped, 40, 512)
    moved = (ops.linear(x, [handle.id]) != planes(x)).any(0)
    assert moved[0] and moved.sum() == 1


@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_every_instruction_set_gives_the_same_bits(variant):
    """The AVX2 and plain-C builds compute bitwise what this machine's build computes (so a result checked on one
    CPU holds on the others): the linear layer, attention and exp."""
    other, native = kernels_or_skip(variant), kernels.ops("native")
    for kind, bits in itertools.product(("Q4_1", "Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K"), (16, 8)):
        blocks = random_blocks(kind, 48, 512, seed=6)
        linear = KernelLinear.from_blocks(blocks, activation_bits=bits)
        quads = bits == 8 and other.quad_layout()  # int8 activations: each build's own layout, the same sums
        assert linear.high_bits == kind.startswith("Q5")  # 5-bit blocks: nibbles + high bits, decoded in each ISA
        packed = _tile_layout(blocks.u, linear.group_size, linear.nibbles, quads, linear.high_bits)
        registered = _register(other, linear, packed, 48, 512)
        x = torch.randn(7, 512, generator=torch.Generator().manual_seed(7))
        assert torch.equal(other.linear(x, [registered.id]), linear(x)), (kind, bits)
    case = _attention_case(rows=5, cached=300, seed=8)
    assert torch.equal(_attend(other, *case), _attend(native, *case))
    values = torch.linspace(-100, 100, 4096)
    assert torch.equal(other.exp_lanes(values), native.exp_lanes(values))


def _grid_law(draw, vocab: int, points: int = 20_000) -> torch.Tensor:
    """The law of ``draw(u)`` over a midpoint grid of ``points`` uniforms (each cell's mass exact to 1/points)."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for token in draw((torch.arange(points, dtype=torch.float64) + 0.5) / points):
        counts[token] += 1
    return counts / points


@pytest.mark.parametrize("variant", ["native", "mutant_residual", "mutant_index", "mutant_block"])
def test_the_mutant_builds_break_the_compiled_draws_and_the_native_one_does_not(variant, monkeypatch):
    """The controls that reach the compiled sampling: the mutant builds whose fault a random row shows (SD_MUTANT_*:
    the residual, the index, the block walk at V = 8, a lone partial block) move the residual draw after a
    rejection or the plain inverse-CDF draw by ≥ 1e-3 in total variation, where the native build is within the
    grid's 1/20,000 of the law (norm(max(0, p − q)), and p). The other mutants' faults need their own inputs:
    tests/kernels/test_kernel_laws.py::test_control_a_mutant_build_of_the_kernels_is_caught."""
    ops = kernels_or_skip(variant) if variant == "native" else mutant_build(variant, monkeypatch)
    gen = torch.Generator().manual_seed(30)
    p, q = torch.rand(2, 8, generator=gen, dtype=torch.float64).softmax(-1).float().unbind()
    x = int(torch.argmax(q / p))  # p(x) / q(x) < 1: a rejection at accept_u just below 1
    target = torch.stack([p, p])
    residual = (p.double() - q.double()).clamp_min(0)
    residual /= residual.sum()

    def chain(us):
        return [ops.exact_chain(target, q[None], torch.tensor([x]), torch.tensor([0.999999], dtype=torch.float64),
                                float(u))[1] for u in us]  # fmt: skip

    def inverse(us):
        return ops.inverse_cdf_rows(p[None].expand(len(us), 8), us).tolist()

    gaps = [
        0.5 * (_grid_law(chain, 8) - residual).abs().sum(),
        0.5 * (_grid_law(inverse, 8) - p.double() / p.double().sum()).abs().sum(),
    ]
    if variant == "native":
        assert max(gaps) < 1e-4, gaps
    else:
        assert max(gaps) > 1e-3, gaps


@pytest.mark.parametrize("variant", list(kernels.MUTANTS))
def test_a_mutant_build_is_refused_outside_the_tests(variant, monkeypatch):
    """A mutant build samples a biased law on purpose: ``SPECDECODE_KERNELS=mutant_*`` and ``kernels.ops(mutant)``
    raise a ValueError that says so (before anything is built or loaded), unless a test turned the switch on
    (helpers.kernels.mutant_build) — and even a build loaded by an earlier test is refused once the switch is off."""
    target = sd.load_model(tiny_llama(16, seed=0))
    monkeypatch.setenv("SPECDECODE_KERNELS", variant)
    with pytest.raises(ValueError, match="deliberately biased build"):
        kernels.runner_variant()
    with pytest.raises(ValueError, match="deliberately biased build"):
        kernels.ops()
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=2)
    with pytest.raises(ValueError, match=f"SPECDECODE_KERNELS={variant} is a deliberately biased build"):
        decoder.generate([1, 2, 1, 2], sd.SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))
    monkeypatch.delenv("SPECDECODE_KERNELS")
    with pytest.raises(ValueError, match="deliberately biased build"):
        kernels.ops(variant)
    with pytest.raises(ValueError, match="deliberately biased build"):
        kernels.build(variant)
    assert kernels.runner_variant() == "native"


def _argmax_cases() -> list[torch.Tensor]:
    """Rows torch.argmax must agree on: random widths (not multiples of the vector lanes), ties at the maximum (the
    first wins), NaN (the first NaN wins, before or after the maximum), ±inf, all -inf, signed zeros."""
    generator = torch.Generator().manual_seed(11)
    cases = [torch.randn(rows, width, generator=generator) for rows, width in ((1, 49152), (3, 1000), (2, 37), (5, 1))]
    ties = torch.randint(0, 4, (4, 300), generator=generator).float()  # many equal maxima per row
    nan_after, nan_before = torch.randn(2, 200, generator=generator), torch.randn(2, 200, generator=generator)
    nan_after[0, 150], nan_after[1, 199] = float("nan"), float("nan")
    nan_before[:, 3], nan_before[:, 90] = float("nan"), float("nan")
    infinite = torch.randn(2, 130, generator=generator)
    infinite[0, 77], infinite[1, 5] = float("inf"), float("-inf")
    minus_inf = torch.full((2, 70), float("-inf"))
    zeros = torch.tensor([[-0.0, 0.0, -1.0] * 30, [-1.0, -0.0, 0.0] * 30])
    return [*cases, ties, nan_after, nan_before, infinite, minus_inf, zeros, torch.randn(8, 4099, generator=generator)]


@pytest.mark.parametrize("variant", ["native", "avx2", "portable"])
def test_argmax_rows_is_torchs_argmax(variant):
    """The kernels' argmax (greedy verification, plain greedy steps) returns torch.argmax's index on every build."""
    ops = kernels.ops("native") if variant == "native" else kernels_or_skip(variant)
    if ops is None:
        pytest.skip("no kernels here")
    for logits in _argmax_cases():
        assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1)), logits.shape
        if logits.shape[1] > 1:  # a strided view
            assert torch.equal(ops.argmax_rows(logits[:, 1:]), logits[:, 1:].argmax(dim=-1))


def test_greedy_tokens_takes_the_kernel_or_torch_with_the_same_result(monkeypatch):
    from specdecode.sampling.probs import greedy_tokens

    cases = _argmax_cases()
    with_kernels = [greedy_tokens(logits) for logits in cases]
    monkeypatch.setenv("SPECDECODE_KERNELS", "0")
    assert kernels.ops() is None
    for logits, chosen in zip(cases, with_kernels, strict=True):
        assert torch.equal(greedy_tokens(logits), chosen) and torch.equal(chosen, logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(cases[0][0].double()), cases[0][0].argmax())  # other shapes: torch's


def test_threads_split_work_never_a_sum():
    """Two threads give bitwise the one-thread results (threads take output columns and attention tasks), and the
    compiled repacker's threads give the one-thread tiles (they take whole tiles: outputs of a tile share bytes of
    the high-bit plane; 40 rows on 3 threads would split tile 0 by rows)."""
    from specdecode.models.gguf.file_blocks import FileBlocks

    blocks = random_blocks("Q4_1", 160, 512, seed=16)
    linear = KernelLinear.from_blocks(blocks)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(17))
    case = _attention_case(rows=6, cached=700, seed=18)
    raw = random_raw("Q5_0", 40, 4096, seed=19)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (
            linear(x),
            _attend(kernels.ops("native"), *case),
            KernelLinear.from_blocks(FileBlocks(_MappedTensor("Q5_0", raw))).packed,
        )
        torch.set_num_threads(2)
        more = linear(x), _attend(kernels.ops("native"), *case)
        torch.set_num_threads(3)
        more += (KernelLinear.from_blocks(FileBlocks(_MappedTensor("Q5_0", raw))).packed,)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, more, strict=True))


def test_exp_is_accurate_and_exact_at_zero():
    values = torch.cat([torch.linspace(-87, 88, 20000), torch.zeros(16)])
    got = kernels.ops("native").exp_lanes(values).double()
    expected = torch.exp(values.double())
    assert ((got - expected).abs() / expected).max() < 3e-7
    assert torch.equal(got[-16:], torch.ones(16, dtype=torch.float64))


# --- attention ---------------------------------------------------------------------------------------------

HEADS, KV_HEADS, DIM = 6, 2, 32


def _attention_case(rows: int, cached: int, seed: int, capacity: int = 2048):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, KV_HEADS, capacity // 16, DIM, 16, generator=gen).half()
    values = torch.randn(1, KV_HEADS, capacity, DIM, generator=gen).half()
    q = torch.randn(rows, HEADS, DIM, generator=gen)
    return q, keys, values, cached


def _chain_meta(rows: int, cached: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    start = torch.arange(cached, cached + rows)
    meta = torch.stack([torch.zeros(rows, dtype=torch.int64), start, start, start + 1], 1).to(torch.int32)
    return meta, torch.zeros(rows + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)


def _attend(ops, q, keys, values, cached, meta=None):
    meta, offsets, extras = _chain_meta(q.shape[0], cached) if meta is None else meta
    return ops.attention(q, [keys], [values], meta, offsets, extras, 0, HEADS, KV_HEADS, DIM**-0.5)


def _reference_attention(q, keys, values, visible: list[int]) -> torch.Tensor:
    """softmax(q·K^T/√d)V in float64 over the slots ``visible``, grouped query heads."""
    k = keys[0].permute(0, 1, 3, 2).reshape(KV_HEADS, -1, DIM).double()[:, visible]  # [kv, T, d]
    v = values[0].double()[:, visible]
    qh = q.double().view(KV_HEADS, HEADS // KV_HEADS, DIM)
    weights = torch.softmax(qh @ k.transpose(1, 2) * DIM**-0.5, dim=-1)
    return (weights @ v).reshape(HEADS, DIM)


@pytest.mark.parametrize("cached", [0, 15, 127, 128, 129, 500, 1500])
def test_attention_is_softmax_attention_and_rows_are_bitwise_one_row_calls(cached):
    q, keys, values, _ = _attention_case(rows=9, cached=cached, seed=cached)
    together = _attend(kernels.ops("native"), q, keys, values, cached)
    for row in range(9):
        expected = _reference_attention(q[row], keys, values, list(range(cached + row + 1)))
        torch.testing.assert_close(together[row].double(), expected, rtol=1e-5, atol=1e-6)
        alone = _attend(kernels.ops("native"), q[row : row + 1], keys, values, cached + row)
        assert torch.equal(alone[0], together[row]), row


@pytest.mark.parametrize("window", [0, 100])
def test_many_rows_take_row_blocks_and_stay_bitwise_one_row_calls(window):
    """From 128 rows (a prefill, a large batched pass) the kernel walks blocks of rows over their chunks instead
    of chunks over rows: every row's bits must not change. Two caches: a 300-row prefill and 40 rows after 150
    cached keys, interleaved, in one call; with a sliding window, rows whose window starts inside a chunk."""
    q, keys, values, _ = _attention_case(rows=340, cached=0, seed=14)
    other_keys, other_values = keys.flip(2).contiguous(), values.flip(2).contiguous()
    prefill = [[1, i, i, i + 1] for i in range(300)]
    after = [[0, 150 + i, 150 + i, 151 + i] for i in range(40)]
    interleaved = [row for pair in zip(prefill[:40], after, strict=True) for row in pair] + prefill[40:]
    meta = torch.tensor(interleaved, dtype=torch.int32)
    offsets, extras = torch.zeros(341, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    caches = ([keys, other_keys], [values, other_values])
    together = kernels.ops("native").attention(q, *caches, meta, offsets, extras, 0, HEADS, KV_HEADS, DIM**-0.5, window)
    for row, (cache, _, _, visible) in enumerate(meta.tolist()):
        one = (meta[row : row + 1], torch.zeros(2, dtype=torch.int64), extras)
        alone = kernels.ops("native").attention(q[row : row + 1], *caches, *one, 0, HEADS, KV_HEADS, DIM**-0.5, window)
        assert torch.equal(alone[0], together[row]), row
        first = visible - window if 0 < window < visible else 0
        expected = _reference_attention(q[row], caches[0][cache], caches[1][cache], list(range(first, visible)))
        torch.testing.assert_close(together[row].double(), expected, rtol=1e-5, atol=1e-6)


def test_tree_rows_see_their_branch_bitwise_as_the_compacted_chain():
    """A tree row attends over the prefix, then its ancestors' slots (anywhere in the cache): bitwise what a
    one-row call computes once those entries sit right after the prefix."""
    q, keys, values, _ = _attention_case(rows=1, cached=0, seed=11)
    prefix, branch = 140, [150, 153, 161]
    meta = torch.tensor([[0, 161, 0, prefix]], dtype=torch.int32)
    tree = _attend(kernels.ops("native"), q, keys, values, 0, (meta, torch.tensor([0, 3]), torch.tensor(branch)))
    compact_k, compact_v = keys.clone(), values.clone()
    for to, at in enumerate(branch, start=prefix):
        compact_k[:, :, to // 16, :, to % 16] = keys[:, :, at // 16, :, at % 16]
        compact_v[:, :, to] = values[:, :, at]
    chain = _attend(kernels.ops("native"), q, compact_k, compact_v, prefix + len(branch) - 1)
    assert torch.equal(tree, chain)
    expected = _reference_attention(q[0], keys, values, list(range(prefix)) + branch)
    torch.testing.assert_close(tree[0].double(), expected, rtol=1e-5, atol=1e-6)


def test_rows_of_different_caches_in_one_call():
    q, keys, values, _ = _attention_case(rows=4, cached=0, seed=12)
    other_keys, other_values = keys.flip(2).contiguous(), values.flip(2).contiguous()
    meta = torch.tensor([[0, 100, 0, 101], [1, 30, 0, 31], [1, 31, 0, 32], [0, 101, 0, 102]], dtype=torch.int32)
    offsets, extras = torch.zeros(5, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    together = kernels.ops("native").attention(
        q, [keys, other_keys], [values, other_values], meta, offsets, extras, 0, HEADS, KV_HEADS, DIM**-0.5
    )
    for row, (cache_k, cache_v, cached) in enumerate(
        [(keys, values, 100), (other_keys, other_values, 30), (other_keys, other_values, 31), (keys, values, 101)]
    ):
        alone = _attend(kernels.ops("native"), q[row : row + 1], cache_k, cache_v, cached)
        assert torch.equal(alone[0], together[row])


def test_bad_rows_are_refused_not_read_out_of_bounds():
    q, keys, values, _ = _attention_case(rows=1, cached=0, seed=13, capacity=64)
    meta = torch.tensor([[0, 70, 0, 71]], dtype=torch.int32)  # slot 70 of a 64-slot cache
    with pytest.raises(RuntimeError, match="outside the cache"):
        _attend(
            kernels.ops("native"),
            q,
            keys,
            values,
            0,
            (meta, torch.zeros(2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)),
        )


# --- the head ----------------------------------------------------------------------------------------------


def test_head_refines_each_rows_top_logits_exactly():
    from specdecode.models.formats.weights import Int8Groups

    blocks = random_blocks("Q8_0", 200, 128, seed=14)
    head = KernelLinear.from_blocks(blocks)
    table = Int8Groups.from_blocks(blocks)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(15))
    norm = torch.rand(128) + 0.5
    logits = kernels.ops("native").lm_head(x, norm, 1e-5, [head.handle.id], 190, table.q, table.scale, 8)
    plain = kernels.ops("native").lm_head(x, norm, 1e-5, [head.handle.id], 190, None, None, 0)
    assert logits.shape == (6, 190)
    h = kernels.ops("native").rms_norm(x, norm, 1e-5).double()
    exact = h @ table.dequantize().double()[:190].T
    changed = logits != plain
    assert bool((changed.sum(1) <= 8).all()) and bool(changed.any())
    top = plain.topk(8, dim=1).indices
    torch.testing.assert_close(logits.gather(1, top).double(), exact.gather(1, top), rtol=1e-6, atol=1e-6)
    ops = kernels.ops("native")
    for row in range(6):  # row-invariant too
        alone = ops.lm_head(x[row : row + 1], norm, 1e-5, [head.handle.id], 190, table.q, table.scale, 8)
        assert torch.equal(alone[0], logits[row])


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_0", "Q5_0"])
def test_a_heads_exact_rows_read_back_from_its_tiles_are_the_int8_tables(kind, bits):
    """A tied head's embedding and exact rows come from its own tiles (no second table): every row bitwise the int8
    table's, in each layout (bytes, nibbles, nibbles + high bits; pairs, and quads with int8 activations), and the
    head's refined logits bitwise those refined from the table. Control: a head of other blocks refines to other
    logits."""
    from specdecode.models.formats.weights import Int8Groups, KernelRows

    blocks = random_blocks(kind, 200, 256, seed=16)  # 200 outputs: a partial last tile
    head = KernelLinear.from_blocks(blocks, activation_bits=bits)
    table, rows = Int8Groups.from_blocks(blocks), KernelRows(head)
    tokens = torch.tensor([[0, 15, 16, 199], [17, 3, 3, 198]])
    assert torch.equal(rows(tokens), table(tokens))
    assert torch.equal(rows.dequantize(), table.dequantize())
    ops = kernels.ops("native")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(17))
    norm = torch.rand(256) + 0.5
    from_table = ops.lm_head(x, norm, 1e-5, [head.handle.id], 190, table.q, table.scale, 8)
    from_tiles = ops.lm_head(x, norm, 1e-5, [head.handle.id], 190, None, None, 8, True)
    assert torch.equal(from_tiles, from_table)
    assert not torch.equal(from_tiles, ops.lm_head(x, norm, 1e-5, [head.handle.id], 190, None, None, 0))
    other = KernelLinear.from_blocks(random_blocks(kind, 200, 256, seed=18), activation_bits=bits)
    assert not torch.equal(ops.lm_head(x, norm, 1e-5, [other.handle.id], 190, table.q, table.scale, 8),
                           ops.lm_head(x, norm, 1e-5, [other.handle.id], 190, None, None, 8, True))  # fmt: skip


# --- how it ships ------------------------------------------------------------------------------------------


def test_one_openmp_runtime_torchs():
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc here")
    runtimes = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes
    assert Path(next(iter(runtimes))).parent == Path(torch.__file__).parent / "lib"


def test_a_failed_build_warns_once_and_leaves_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="CPU kernels unavailable"):
        assert kernels._load("native") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels._load("portable") is None  # a test variant fails silently


def test_the_build_is_cached_per_machine_and_source(monkeypatch, tmp_path):
    """The cache logic, with g++'s compile replaced by a stand-in (the real compile, ~90 s from a cold cache, is
    what every kernel test here loads); an edit to any file of csrc/ is a new build."""
    real_run, compiles = kernels.subprocess.run, []

    def run(command, *args, **kwargs):
        if "-o" not in command:  # g++ --version, part of the cache key
            return real_run(command, *args, **kwargs)
        compiles.append(command)
        Path(command[command.index("-o") + 1]).write_bytes(b"library")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(kernels.subprocess, "run", run)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    sources = tmp_path / "csrc"
    shutil.copytree(kernels.SOURCES, sources)
    monkeypatch.setattr(kernels, "SOURCES", sources)
    first = kernels.build("portable")
    stamp = first.stat().st_mtime_ns
    assert kernels.build("portable") == first and first.stat().st_mtime_ns == stamp  # no second build
    assert len(compiles) == 1 and first.parent.parent == tmp_path / "kernels"
    assert kernels.build("avx2").parent != first.parent and len(compiles) == 2  # one build per variant
    (sources / "simd.h").write_text((sources / "simd.h").read_text() + "// an edit to a part ops.cpp includes\n")
    assert kernels.build("portable").parent != first.parent and len(compiles) == 3


# --- the runner on every GGUF block type -------------------------------------------------------------------

LAYOUTS = [  # one block type per linear of each layer (q, k, v, o, gate, up, down)
    ("Q4_0", "Q4_0", "Q4_0", "Q4_1", "Q5_0", "Q5_0", "Q5_1"),
    ("Q4_K", "Q4_K", "Q4_K", "Q5_K", "Q6_K", "Q6_K", "Q8_0"),
    ("Q5_0", "Q5_0", "Q6_K", "Q8_0", "Q4_K", "Q4_K", "Q6_K"),  # mixed within q/k/v (a Q4_K_M-like file)
]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _gguf_model(kinds, monkeypatch):
    """A tiny Llama whose linears hold random GGUF blocks of ``kinds`` and whose tied embedding is Q8_0, loaded
    as quantization="gguf" loads a file (the file's reader replaced), plus its dense twin (the same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdecode.models.loading import loader, quantize

    config = LlamaConfig(
        vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    stored, types, seed = {}, {}, 100
    for index, layer in enumerate(model.model.layers):
        for name, kind in zip(LINEARS, kinds, strict=True):
            module = layer.get_submodule(name)
            scale = 0.002 if kind.endswith(("8_0", "6_K")) else 0.02
            stored[f"model.layers.{index}.{name}.weight"] = random_blocks(
                kind, module.out_features, module.in_features, seed, scale
            )
            types[f"model.layers.{index}.{name}.weight"] = kind
            seed += 1
    stored["model.embed_tokens.weight"] = random_blocks("Q8_0", 96, 256, seed, 0.002)
    types["model.embed_tokens.weight"] = "Q8_0"
    dense = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param, twin in zip(model.parameters(), dense.parameters(), strict=True):
            twin.copy_(param)
        for name, blocks in stored.items():
            dense.get_parameter(name).copy_(blocks.dequantize())
            model.get_parameter(name).copy_(blocks.dequantize())

    def read(path, model, found_types=None):
        found_types.update(types)
        return stored

    monkeypatch.setattr(quantize, "read_gguf_tensors", read)
    formats = quantize.quantize_model(model, quantize.Quantization("gguf"), gguf_path=Path("random.gguf"))
    expected = {"Q8_0 head": 1}
    for kind in list(kinds) * config.num_hidden_layers:
        expected[kind] = expected.get(kind, 0) + 1
    assert formats == expected  # what describe() reports: matrices per stored GGUF type
    loaded = loader._wrap(model, None, "tiny-gguf", "auto")
    loaded.quantization = "gguf"
    return loaded, dense


@pytest.mark.parametrize("kinds", LAYOUTS, ids=["q4-q5", "k-quants", "mixed"])
def test_the_runner_on_every_gguf_block_type_is_row_invariant_and_computes_the_files_weights(kinds, monkeypatch):
    loaded, dense = _gguf_model(kinds, monkeypatch)
    runner = loaded.new_runner()
    assert runner.uses_kernels
    ids = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = dense(ids[None]).logits[0]
    logits = runner.forward(ids)
    assert (logits - reference).norm() / reference.norm() < 2e-3  # int16 activations, a float16 cache
    for context in (1, 129):  # past one 128-key attention chunk
        for k in (2, 5, 12):
            runner.reset()
            runner.prefill(ids[:context])
            together = runner.forward(ids[context : context + k])
            runner.rollback_to(context)
            singles = torch.cat([runner.forward(ids[context + i : context + i + 1]) for i in range(k)])
            assert torch.equal(together, singles), (context, k)


def _sampled_tokens(ops, vocab: int) -> list:
    """What ``exact_chain`` (sampled q and point masses; each row rejected in turn, and all accepted) and
    ``inverse_cdf_rows`` give on float32 rows at uniforms spread over [0, 1) and at reference boundaries ± 1e-12
    (where another order of the float64 sums would move a draw)."""
    gen = torch.Generator().manual_seed(vocab + 1)
    k = 4
    target = torch.softmax(3 * torch.randn(k + 1, vocab, generator=gen), -1)
    draft = torch.softmax(target[:k].log() + torch.randn(k, vocab, generator=gen), -1)
    guesses = torch.multinomial(draft.double(), 1, generator=gen).flatten()
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
    edges = target[0].double().cumsum(0)[torch.randperm(vocab, generator=gen)[:32]].clamp_max(1 - 1e-12)
    uniforms = torch.cat([uniforms, edges - 1e-12, edges + 1e-12, torch.tensor([0.0, 1 - 2**-53])]).clamp_min(0.0)
    drawn = [ops.inverse_cdf_rows(target[:1].expand(len(uniforms), vocab), uniforms).tolist()]
    for probs in (draft, None):
        for reject_at in range(k + 1):  # the rows before accepted, the rest at u just below 1 (k: the bonus)
            accept_u = torch.zeros(k, dtype=torch.float64)
            accept_u[reject_at:] = 1 - 2**-53
            drawn += [list(ops.exact_chain(target, probs, guesses, accept_u, u)) for u in uniforms.tolist()]
    excluded = target.clone()  # guess 0 given p = 0: rejected even at u = 0 (accept iff u < p/q, strict)
    excluded[0, guesses[0]] = 0.0
    drawn.append(list(ops.exact_chain(excluded, draft, guesses, torch.zeros(k, dtype=torch.float64), 0.5)))
    a, b = torch.argsort(target[0], descending=True)[:2].tolist()  # q = p but 5e-5 moved from b to a, guess a: a
    near = target[:1].clone()  # rejection's residual is 5e-5 on b, above the eps fallback
    near[0, a], near[0, b] = near[0, a] + 5e-5, near[0, b] - 5e-5
    rejected = torch.tensor([1 - 2**-53], dtype=torch.float64)
    drawn += [list(ops.exact_chain(target[:2], near, torch.tensor([a]), rejected, u)) for u in uniforms.tolist()]
    return drawn


@pytest.mark.parametrize("vocab", [8, 49_157])
@pytest.mark.parametrize("variant", ["avx2", "portable", *kernels.MUTANTS])
def test_every_instruction_set_samples_the_same_tokens(variant, vocab, monkeypatch):
    """The exact-sampling ops (``exact_chain``, ``inverse_cdf_rows``, float32 rows) give bitwise this machine's
    build's tokens on the AVX2 and plain-C builds (issue 53), at a vocabulary inside one 64-entry block and at one
    that ends in a partial block. Control: each mutant build (kernels.MUTANTS) gives other tokens somewhere on the
    same inputs (a guess with p = 0 at u = 0 and a residual of mass 5e-5 among them)."""
    ops = mutant_build(variant, monkeypatch) if variant in kernels.MUTANTS else kernels_or_skip(variant)
    same = _sampled_tokens(ops, vocab) == _sampled_tokens(kernels.ops("native"), vocab)
    assert same is (variant not in kernels.MUTANTS), variant
