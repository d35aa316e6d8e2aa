"""The fast GGUF index gives what gguf's own reader gives: the architecture and every tensor's name, type,
shape and bytes, past metadata of every value type (strings, arrays of strings, nested arrays, a custom
alignment); files it does not read (another byte order) go to gguf's reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specdecode.models.gguf_index import gguf_index, read_gguf_index, read_gguf_index_with_gguf


def _write(path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = 64) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" if i % 7 else "" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_array("tokenizer.ggml.token_type", list(range(300)))
    writer.add_array("nested", [[1, 2, 3], [4]])
    writer.add_array("nested.strings", [["a", "bc"], ["déf"]])
    writer.add_bool("flag", True)
    writer.add_uint8("u8", 7)
    writer.add_uint16("u16", 7)
    writer.add_uint64("u64", 2**40)
    writer.add_float64("f64", 0.5)
    writer.add_int32("i32", -3)
    writer.add_tensor("token_embd.weight", rng.standard_normal((10, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    writer.add_tensor("positions", np.arange(5, dtype=np.int32))
    q8 = rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8)  # 4 rows of 64: two Q8_0 blocks a row
    writer.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    q41 = rng.integers(0, 256, (3, 2 * 20), dtype=np.uint8)  # 3 rows of 64: two Q4_1 blocks a row
    writer.add_tensor("blk.0.ffn_down.weight", q41, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _summary(index) -> list[tuple]:
    return [(t.name, t.tensor_type, t.data.shape, np.asarray(t.data, dtype=t.data.dtype.newbyteorder("=")).tolist())
            for t in index.tensors]  # fmt: skip


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_the_index_equals_ggufs_reader(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    _write(path, alignment=alignment)
    fast, reference = read_gguf_index(path), read_gguf_index_with_gguf(path)
    assert fast.architecture == reference.architecture == "llama"
    assert len(fast.tensors) == 5
    assert _summary(fast) == _summary(reference)
    assert [t.data.dtype for t in fast.tensors] == [t.data.dtype for t in reference.tensors]


def test_another_byte_order_goes_to_ggufs_reader(tmp_path):
    little, big = tmp_path / "little.gguf", tmp_path / "big.gguf"
    _write(little)
    _write(big, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match="version"):
        read_gguf_index(big)
    values = [(t.name, t.tensor_type, t.data.shape) for t in gguf_index(big).tensors]
    assert values == [(t.name, t.tensor_type, t.data.shape) for t in gguf_index(little).tensors]
    assert np.array_equal(gguf_index(big).tensors[0].data, gguf_index(little).tensors[0].data)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_index(path)


def test_a_file_cut_short_is_refused(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path)
    whole = path.read_bytes()
    for keep, message in ((200, "header is cut short"), (len(whole) - 10, "runs past the end")):
        path.write_bytes(whole[:keep])
        with pytest.raises(ValueError, match=message):
            read_gguf_index(path)
        with pytest.raises(ValueError, match=message):
            gguf_index(path)  # not handed to gguf's reader, whose error would not say what is wrong
