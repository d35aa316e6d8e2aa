"""Weight formats: exact decoding of GGUF blocks, quantizer round trips, and row invariance of every kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize

from specdecode.models.formats.weights import ACTIVATION_DTYPE, DenseLinear, GroupQuant, Int4Linear, Int8Linear
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

ROWS, COLS = 128, 256


def _blocks(rows: int, blocks: int, size: int, halves_at: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random GGUF blocks whose f16 fields (at byte offsets ``halves_at``) hold small finite values."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for at in halves_at:
        raw[..., at : at + 2] = rng.uniform(-0.05, 0.05, size=(rows, blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize(
    ("decode", "kind", "size", "halves", "per_row"),
    [
        (decode_q4_0, GGMLQuantizationType.Q4_0, 18, (0,), 32),
        (decode_q4_1, GGMLQuantizationType.Q4_1, 20, (0, 2), 32),
        (decode_q4_k, GGMLQuantizationType.Q4_K, 144, (0, 2), 256),
        (decode_q5_0, GGMLQuantizationType.Q5_0, 22, (0,), 32),
        (decode_q5_1, GGMLQuantizationType.Q5_1, 24, (0, 2), 32),
        (decode_q5_k, GGMLQuantizationType.Q5_K, 176, (0, 2), 256),
        (decode_q6_k, GGMLQuantizationType.Q6_K, 210, (208,), 256),
        (decode_q8_0, GGMLQuantizationType.Q8_0, 34, (0,), 32),
    ],
)
def test_gguf_blocks_decode_as_gguf_does(decode, kind, size, halves, per_row):
    raw = _blocks(16, COLS // per_row, size, halves)
    expected = torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32))
    decoded = decode(raw).dequantize()
    assert decoded.shape == expected.shape == (16, COLS)
    torch.testing.assert_close(decoded, expected, rtol=1e-6, atol=1e-6)  # float32 rounding, nothing else


def test_q4_k_is_not_decodable_with_the_wrong_nibble_order():
    """The negative control: swapping the sub-block halves must break the comparison above."""
    raw = _blocks(4, 1, 144, (0, 2), seed=1)
    expected = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType.Q4_K), dtype=np.float32))
    decoded = decode_q4_k(raw).dequantize().view(4, 4, 2, 32).flip(2).reshape(4, 256)
    assert not torch.allclose(decoded, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_group_quant_round_trip_error_is_half_a_step(group_size):
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    quant = GroupQuant.quantize(weight, group_size)
    assert quant.q.dtype == torch.uint8 and int(quant.q.max()) <= 15
    error = (quant.dequantize() - weight).view(ROWS, -1, group_size).abs().amax(-1)
    assert torch.all(error <= quant.scale * 0.5 * (1 + 1e-5))


def test_group_quant_refuses_bad_group_size():
    with pytest.raises(ValueError, match="group size"):
        GroupQuant.quantize(torch.randn(16, 96), 64)


def test_int8_round_trip_error_is_half_a_step():
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1))
    quant = Int8Linear.quantize(weight)
    error = (quant.dequantize() - weight).abs().amax(-1)
    assert torch.all(error <= quant.scale.float() * 0.5 * (1 + 1e-5))


def _formats() -> dict[str, object]:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(ROWS, COLS, generator=generator) * 0.1
    bias = torch.randn(ROWS, generator=generator)
    return {
        "dense-float32": DenseLinear(weight),
        "dense-float32-bias": DenseLinear(weight, bias),
        "dense-bfloat16": DenseLinear(weight.bfloat16()),
        "int8": Int8Linear.quantize(weight, bias),
        "int4-g32": Int4Linear.from_groups(GroupQuant.quantize(weight, 32), bias),
        "int4-g128": Int4Linear.from_groups(GroupQuant.quantize(weight, 128)),
    }


@pytest.mark.parametrize("name", list(_formats()))
def test_every_format_is_row_invariant(name):
    """Row r of a k-row product is bitwise the one-row product of row r, for k = 1..32."""
    linear = _formats()[name]
    dtype = torch.bfloat16 if name == "dense-bfloat16" else torch.float32
    x = torch.randn(32, COLS, generator=torch.Generator().manual_seed(3)).to(dtype)
    singles = [linear(x[r : r + 1])[0] for r in range(32)]
    for k in range(1, 33):
        out = linear(x[:k])
        assert out.shape == (k, ROWS)
        for r in range(k):
            assert torch.equal(out[r], singles[r]), f"{name}: row {r} of a {k}-row call differs"


def test_dense_bfloat16_is_row_invariant_past_32_rows():
    """Past 32 rows bfloat16 F.linear takes another path on a CPU with AMX (oneDNN's tiles: found on an Intel Xeon,
    family 6 model 207, where the bundled model's 144-row batch broke); DenseLinear keeps each row its own."""
    generator = torch.Generator().manual_seed(5)
    linear = DenseLinear((torch.randn(576, 576, generator=generator) * 0.05).bfloat16())
    x = torch.randn(80, 576, generator=generator).bfloat16()
    singles = torch.cat([linear(x[r : r + 1]) for r in range(80)])
    for k in (33, 48, 64, 65, 80):
        assert torch.equal(linear(x[:k]), singles[:k]), k
    assert linear(x[:0]).shape == (0, 576)


@pytest.mark.parametrize("group_size", [32, 256])
def test_int4_kernel_computes_the_dequantized_product(group_size):
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(ROWS, COLS, generator=generator)
    quant = GroupQuant.quantize(weight, group_size)
    x = torch.randn(5, COLS, generator=generator)
    exact = x.to(ACTIVATION_DTYPE).double() @ quant.dequantize().double().t()
    out = Int4Linear.from_groups(quant)(x).double()
    # bfloat16 scales and a bfloat16 output: a few parts in a thousand of the row's scale.
    assert ((out - exact).norm() / exact.norm()).item() < 1e-2


def test_row_slices_compute_through_the_fused_matrix():
    from specdecode.models.formats.weights import RowSlice

    fused = Int4Linear.from_groups(GroupQuant.quantize(torch.randn(192, COLS), 32))
    x = torch.randn(3, COLS)
    part = RowSlice(fused, 64, 192)
    assert torch.equal(part(x), fused(x)[:, 64:])
