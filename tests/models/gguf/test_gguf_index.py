"""The fast GGUF index gives what gguf's own reader gives: the architecture and every tensor's name, type,
shape and bytes, past metadata of every value type (strings, arrays of strings, nested arrays, a custom
alignment); files it does not read (another byte order) go to gguf's reader. The reader transformers gets
while building a dense copy (a plain-view GGUFReader) reads what gguf's reads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from specdecode.models.gguf.index import gguf_index, read_gguf_index, read_gguf_index_with_gguf
from specdecode.models.gguf.transformers_speedups import PlainViewReader, faster_transformers_gguf


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


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_the_scalar_values_are_ggufs_readers_and_arrays_are_left_out(tmp_path, endianess):
    path = tmp_path / "tiny.gguf"
    _write(path, endianess=endianess)
    values = gguf_index(path).values
    assert values == read_gguf_index_with_gguf(path).values
    assert values["general.name"] == "tiny ünïcode" and values["u64"] == 2**40 and values["i32"] == -3
    assert values["f64"] == 0.5 and values["flag"] is True and values["general.alignment"] == 64
    assert "tokenizer.ggml.tokens" not in values and "nested" not in values


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


def _reader_summary(reader) -> tuple[list, list]:
    fields = [(name, f.offset, f.types, f.data, [(p.dtype.str, p.shape, p.tobytes()) for p in f.parts])
              for name, f in reader.fields.items()]  # fmt: skip
    tensors = [(t.name, t.tensor_type, tuple(t.shape), t.n_elements, t.n_bytes, t.data_offset, t.data.dtype.str,
                t.data.shape, t.data.tobytes()) for t in reader.tensors]  # fmt: skip
    return fields, tensors


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_the_plain_view_reader_reads_what_ggufs_reader_reads(tmp_path, endianess):
    path = tmp_path / "tiny.gguf"
    _write(path, endianess=endianess)
    plain, reference = PlainViewReader(str(path)), gguf.GGUFReader(str(path))
    assert type(plain.fields["tokenizer.ggml.tokens"].parts[5]) is np.ndarray  # not a memmap: the point of it
    assert _reader_summary(plain) == _reader_summary(reference)
    assert len(plain.fields["tokenizer.ggml.tokens"].data) == 300


def test_faster_transformers_gguf_parses_a_file_once_and_puts_gguf_back(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path)
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with faster_transformers_gguf():
        first, again = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(path))
        assert first is again and isinstance(first, PlainViewReader)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    with pytest.raises(RuntimeError, match="inside"), faster_transformers_gguf():
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)


def test_a_process_that_finds_the_dense_copy_being_built_waits_and_reads_it(tmp_path, monkeypatch, capsys):
    """Two servers (or test workers) starting together: the second waits on the first's lock, says so, and reads
    its copy instead of converting the file again. The test holds the lock as the first process would; a thread is
    the second (flock locks an open file, not a process)."""
    import threading
    import time

    from specdecode.disk_cache import exclusive
    from specdecode.models.gguf import conversions as gguf_cache

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf_file = tmp_path / "tiny.gguf"
    _write(gguf_file)
    folder, builds, found = gguf_cache.dense_folder(gguf_file), [], []
    monkeypatch.setattr(gguf_cache, "_build_dense_copy", lambda gguf_path, out: builds.append(out))
    second = threading.Thread(target=lambda: found.append(gguf_cache.dense_cache(gguf_file)))
    with exclusive(gguf_cache.build_lock(folder), "a test's build"):
        second.start()
        said, deadline = "", time.monotonic() + 60
        while "waiting" not in said and time.monotonic() < deadline:
            time.sleep(0.01)
            said += capsys.readouterr().err
        assert "waiting for another process to finish the first-use copy of tiny.gguf" in said
        folder.mkdir(parents=True)  # the first process's copy, written before it lets go
        (folder / "config.json").write_text("{}")
    second.join(60)
    assert found == [folder] and builds == []
