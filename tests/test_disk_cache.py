"""The cache's entries: written whole or not at all, checked before use, healed when damaged (a cut file, a changed
byte, a missing manifest), a full disk ending in one line with nothing half-written; and the compiled kernel
library, cut to 5,000 bytes as a full disk leaves it, rebuilt with one warning line instead of a bus error."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode import disk_cache as entry_cache
from specdecode import kernels
from specdecode.disk_cache import CacheFull, ensure_entry, entries, problem, write_entry


def writer(payload: bytes, calls: list[int] | None = None):
    """A builder that writes ``payload`` to data.bin and a small config.json, counting its calls."""

    def write(staging: Path) -> None:
        if calls is not None:
            calls.append(1)
        (staging / "data.bin").write_bytes(payload)
        (staging / "config.json").write_text("{}")

    return write


def test_a_written_entry_is_whole_and_passes_its_checks(cache):
    folder = cache / "dense" / "model-abc"
    write_entry(folder, writer(b"x" * 10_000), {"source": "model.gguf"})
    assert problem(folder) is None and problem(folder, checksums=True) is None
    assert [p.name for p in folder.parent.iterdir()] == ["model-abc"]  # no staging left
    [entry] = entries(cache)
    assert (entry.kind, entry.size > 10_000, entry.problem, entry.meta) == (
        "dense",
        True,
        None,
        {"source": "model.gguf"},
    )


def test_a_cut_entry_is_rebuilt_with_one_warning_line(cache, capsys):
    folder = cache / "dense" / "model-abc"
    calls: list[int] = []
    ensure_entry(folder, "the dense copy", writer(b"x" * 10_000, calls))
    capsys.readouterr()
    with open(folder / "data.bin", "r+b") as handle:
        handle.truncate(5_000)
    assert "data.bin is 5,000 bytes, 10,000 when built" in problem(folder)
    ensure_entry(folder, "the dense copy", writer(b"x" * 10_000, calls))
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(calls) == 2 and len(warning) == 1 and "damaged" in warning[0] and "rebuilding" in warning[0]
    assert (folder / "data.bin").stat().st_size == 10_000 and problem(folder, checksums=True) is None
    ensure_entry(folder, "the dense copy", writer(b"x" * 10_000, calls))  # whole now: used as it is
    assert len(calls) == 2 and capsys.readouterr().err == ""


def test_a_changed_byte_is_caught_by_the_checksum_at_first_use_after_the_build(cache):
    folder = cache / "dense" / "model-abc"
    write_entry(folder, writer(b"x" * 10_000))
    (folder / "data.bin").write_bytes(b"y" + b"x" * 9_999)  # the same size: only the checksum tells
    assert "checksum" in problem(folder)
    write_entry(folder, writer(b"x" * 10_000))
    assert problem(folder) is None  # the first use: checksums verified, and recorded
    assert entry_cache.read_manifest(folder).verified
    (folder / "data.bin").write_bytes(b"y" + b"x" * 9_999)
    assert problem(folder) is None  # later uses check sizes only
    assert "checksum" in problem(folder, checksums=True)


def test_an_entry_without_a_manifest_is_rebuilt_unless_adopted_whole(cache, capsys):
    folder = cache / "kernels" / "native-abc"
    folder.mkdir(parents=True)
    (folder / "lib.so").write_bytes(b"old")
    calls: list[int] = []
    ensure_entry(folder, "the kernels", writer(b"new", calls), adopt=lambda f: (f / "lib.so").read_bytes() == b"old")
    assert calls == [] and (folder / "lib.so").read_bytes() == b"old" and problem(folder) is None
    (folder / entry_cache.MANIFEST).unlink()
    ensure_entry(folder, "the kernels", writer(b"new", calls), adopt=lambda f: False)
    assert calls == [1] and (folder / "data.bin").read_bytes() == b"new" and not (folder / "lib.so").exists()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_is_one_line_and_leaves_nothing_half_written(cache, code):
    folder = cache / "dense" / "model-abc"

    def fills_the_disk(staging: Path) -> None:
        (staging / "data.bin").write_bytes(b"x" * 3_000)
        raise OSError(code, os.strerror(code))

    with pytest.raises(CacheFull) as caught:
        ensure_entry(folder, "the dense copy", fills_the_disk, expected=2**20)
    message = str(caught.value)
    assert "\n" not in message and str(folder.parent) in message and "1,048,576 bytes" in message
    assert not folder.exists() and [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_a_write_that_fails_otherwise_raises_as_it_was_and_leaves_nothing(cache):
    folder = cache / "dense" / "model-abc"

    def fails(staging: Path) -> None:
        (staging / "data.bin").write_bytes(b"x")
        raise RuntimeError("converter bug")

    with pytest.raises(RuntimeError, match="converter bug"):
        ensure_entry(folder, "the dense copy", fails)
    assert [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == []


@pytest.fixture(scope="module")
def built_library() -> Path:
    """The native library in the user's cache (compiled once there; before ``cache`` points elsewhere)."""
    return kernels.build("native")


def test_the_elf_check_tells_a_cut_library_from_a_whole_one(built_library, tmp_path):
    copy = tmp_path / "lib.so"
    copy.write_bytes(built_library.read_bytes())
    assert kernels.whole_elf(copy)
    with open(copy, "r+b") as handle:
        handle.truncate(5_000)
    assert not kernels.whole_elf(copy)


FAKE_COMPILER = """#!/bin/sh
# g++ stand-in: --version names it; a build copies a library compiled earlier to the path after -o
if [ "$1" = "--version" ]; then echo "fake-g++ 1.0"; exit 0; fi
while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then cp "$LIBRARY" "$2"; exit 0; fi; shift; done
exit 1
"""
LOAD = "import specdecode.kernels as k; print('loaded' if k.ops('native') is not None else 'none')"


def test_a_kernel_library_cut_to_5000_bytes_is_rebuilt_with_one_warning_not_a_bus_error(built_library, cache, tmp_path):
    """In a fresh process, as every command starts: before the fix, loading the cut library died with SIGBUS (135).
    The compiler is a stand-in that copies the real build (a compile takes ~40 s of CPU; the real build path runs
    in every other test that loads the kernels)."""
    compiler = tmp_path / "fake-g++"
    compiler.write_text(FAKE_COMPILER)
    compiler.chmod(0o755)
    env = {**os.environ, "SPECDECODE_CACHE": str(cache), "CXX": str(compiler), "OMP_NUM_THREADS": "1",
           "LIBRARY": str(built_library)}  # fmt: skip
    first = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert (first.returncode, first.stdout.strip()) == (0, "loaded"), first.stderr
    [library] = (cache / "kernels").glob("native-*/*.so")
    with open(library, "r+b") as handle:
        handle.truncate(5_000)
    healed = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert (healed.returncode, healed.stdout.strip()) == (0, "loaded"), healed.stderr
    warnings = [line for line in healed.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "5,000 bytes" in warnings[0] and "rebuilding" in warnings[0]
    assert kernels.whole_elf(library)


def test_a_cut_dense_copy_is_rebuilt_by_the_loader_with_one_warning(cache, tmp_path, monkeypatch, capsys):
    """The loader's entries (dense copies, GGUF metadata) go through ``ensure_entry``: a model.safetensors cut
    short (before: every load ended in safetensors' "incomplete metadata" traceback) is rebuilt. The conversion
    is a stand-in that writes a small safetensors file."""
    import torch
    from safetensors.torch import save_file

    from specdecode.models.gguf import conversions as gguf_cache

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    builds: list[Path] = []

    def convert(source: Path, staging: Path) -> None:
        builds.append(staging)
        (staging / "config.json").write_text("{}")
        save_file({"weight": torch.zeros(64, 64)}, str(staging / "model.safetensors"))

    monkeypatch.setattr(gguf_cache, "_build_dense_copy", convert)
    folder = gguf_cache.dense_cache(gguf)
    weights = folder / "model.safetensors"
    assert entry_cache.whole_safetensors(weights) and len(builds) == 1
    with open(weights, "r+b") as handle:
        handle.truncate(5_000)
    assert not entry_cache.whole_safetensors(weights)
    capsys.readouterr()
    assert gguf_cache.dense_cache(gguf) == folder and len(builds) == 2
    [warning] = capsys.readouterr().err.strip().splitlines()
    assert "damaged" in warning and "model.safetensors is 5,000 bytes" in warning
    assert entry_cache.whole_safetensors(weights)
    [entry] = [e for e in entries(cache) if e.kind == "dense"]
    assert entry.meta["source"] == str(gguf.resolve()) and entry.problem is None


def test_a_suffix_history_written_to_a_full_disk_is_one_line_and_leaves_the_old_file(tmp_path, monkeypatch):
    """The history the server writes back at shutdown: a full disk leaves the previous file whole and no staging
    file; the next save, with room, replaces it."""
    from specdecode.proposers import SuffixHistory

    history = SuffixHistory(1000)
    history.add([1, 2, 3, 4])
    path = tmp_path / "history.bin"
    history.save(path)
    before = path.read_bytes()
    history.add([5, 6, 7])
    real_write = Path.write_bytes

    def full(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(CacheFull) as caught:
        history.save(path)
    assert "\n" not in str(caught.value) and str(tmp_path) in str(caught.value) and "bytes" in str(caught.value)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["history.bin"]
    monkeypatch.undo()
    history.save(path)
    assert len(SuffixHistory.load(path).index) == len(history.index)


@pytest.mark.slow
def test_the_real_build_of_a_cut_library_heals_and_loads(cache):
    """The same with this machine's g++ (two builds of the portable variant, ~30 s each): the rebuilt library
    loads in a fresh process and is whole."""
    library = kernels.build("portable")
    with open(library, "r+b") as handle:
        handle.truncate(5_000)
    load = "import specdecode.kernels as k; print('loaded' if k.ops('portable') is not None else 'none')"
    env = {**os.environ, "SPECDECODE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    healed = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600)
    assert (healed.returncode, healed.stdout.strip()) == (0, "loaded"), healed.stderr
    assert "5,000 bytes" in healed.stderr and kernels.whole_elf(library) and problem(library.parent) is None
