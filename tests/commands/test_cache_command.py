"""``specdecode cache``: lists entries with sizes, last use and state (stale: another torch, a GGUF file gone or
changed; damaged: cut short, half-written), and ``cache clean`` removes all, the old or the stale ones."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specdecode import cli, kernels
from specdecode.disk_cache import MANIFEST, STAGING_PREFIX, entries, source_meta, write_entry

runner = CliRunner()
DAY = 86_400


def _entry(folder: Path, meta: dict | None, size: int = 2_000, days_unused: float = 0.0) -> Path:
    write_entry(folder, lambda staging: (staging / "data.bin").write_bytes(b"x" * size), meta)
    used = time.time() - days_unused * DAY
    os.utime(folder / MANIFEST, (used, used))
    return folder


@pytest.fixture
def filled(cache, tmp_path) -> dict[str, Path]:
    """A cache of five entries: in use, unused for 40 days, from a GGUF file since deleted, a kernel build for
    another torch, and one cut short; plus the staging folder an interrupted write left."""
    gguf, gone = tmp_path / "model.gguf", tmp_path / "gone.gguf"
    gguf.write_bytes(b"GGUF")
    gone.write_bytes(b"GGUF")
    other_torch = {**kernels.built_for("native"), "torch": "1.0.0"}
    found = {
        "fresh": _entry(cache / "dense" / "model-aaa", source_meta(gguf)),
        "old": _entry(cache / "gguf" / "model-bbb", source_meta(gguf), days_unused=40),
        "gone": _entry(cache / "dense" / "gone-ccc", source_meta(gone)),
        "torch": _entry(cache / "kernels" / f"native-{other_torch['key']}", other_torch),
        "cut": _entry(cache / "dense" / "model-ddd", source_meta(gguf), size=9_000),
    }
    gone.unlink()
    with open(found["cut"] / "data.bin", "r+b") as handle:
        handle.truncate(5_000)
    (cache / "dense" / f"{STAGING_PREFIX}xyz").mkdir()
    return found


def _invoke(*args: str):
    result = runner.invoke(cli.app, ["cache", *args])
    assert result.exit_code == 0, result.output
    return result.output


def _rows(output: str) -> dict[str, str]:
    return {name: line for line in output.splitlines() for name in ("aaa", "bbb", "ccc", "ddd", "xyz") if name in line}


def test_the_listing_shows_each_entry_with_its_state(filled):
    rows = _rows(_invoke())
    assert "ok" in rows["aaa"] and "ok" in rows["bbb"] and "40 days ago" in rows["bbb"]
    assert "stale" in rows["ccc"] and "gone" in rows["ccc"]
    assert "damaged" in rows["ddd"] and "5,000 bytes" in rows["ddd"]
    assert "interrupted" in rows["xyz"]
    torch_row = next(line for line in _invoke().splitlines() if filled["torch"].name[:20] in line)
    assert "stale" in torch_row and "torch 1.0.0" in torch_row


def test_clean_stale_removes_only_what_is_of_no_use_here(filled, cache):
    _invoke("clean", "--stale")
    left = {p.name for p in (cache / "dense").iterdir() if not p.name.endswith(".lock")}
    assert left == {"model-aaa"} and filled["old"].exists() and not filled["torch"].exists()


def test_clean_older_than_removes_only_the_entries_unused_that_long(filled):
    assert "would remove 1 cache entries" in runner.invoke(cli.app, ["cache", "clean", "--older-than", "30",
                                                                    "--dry-run"]).output  # fmt: skip
    assert filled["old"].exists()
    _invoke("clean", "--older-than", "30")
    assert not filled["old"].exists() and filled["fresh"].exists() and filled["gone"].exists()


def test_clean_without_options_empties_the_cache(filled, cache):
    _invoke("clean")
    assert entries(cache) == [] and not any(p.is_file() and not p.name.endswith(".lock") for p in cache.rglob("*"))
    assert "is empty" in runner.invoke(cli.app, ["cache"]).output
