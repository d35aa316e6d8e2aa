"""specdecode's on-disk cache (GGUF metadata and dense copies, compiled kernels, synthetic models): entries that are
written whole or not at all, checked before use and rebuilt when damaged, and the lock that lets one process at a
time build an entry.

An entry is a folder. It is written under a staging name beside its place and renamed into place only once every
file is written, with ``manifest.json`` listing each file's size and SHA-256 (and what it was built for). Before
use its sizes are compared with the manifest (cheap, every time), and its checksums at the first use after a build
or when a size differs; a damaged, half-written or manifest-less entry is rebuilt with one warning line. A full
disk while writing ends in ``CacheFull`` (one line naming the folder and the bytes needed), nothing half-written
left behind. The manifest's modification time is the entry's last use.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SpecDecodeError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
_CHUNK = 1 << 20


class CacheFull(SpecDecodeError, OSError):
    """No space (or no permission) left to write a cache entry; nothing half-written was left behind."""


def cache_root() -> Path:
    """Where the cache lives: $SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode."""
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdecode"


@contextmanager
def exclusive(lock_file: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if need be): one builder of a cache entry at a time
    across processes (two servers or test workers starting at once); released when the block ends or the
    process dies. Waiting for another process says so on stderr, naming ``what`` it builds."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"specdecode: waiting for another process to finish {what} ...", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def lock_of(folder: Path) -> Path:
    """The lock file an entry's builder holds, beside the entry (the entry itself is replaced whole)."""
    return folder.parent / f".{folder.name}.lock"


@dataclass(frozen=True)
class Manifest:
    """What an entry holds: each file's size and SHA-256 (path relative to the entry), when it was built, whether
    its checksums were verified since, and ``meta``: what it was built for (torch, compiler, source file)."""

    files: dict[str, dict[str, Any]]
    built: float
    verified: bool = False
    meta: dict[str, Any] | None = None

    @property
    def size(self) -> int:
        return sum(int(item["size"]) for item in self.files.values())


def read_manifest(folder: Path) -> Manifest | None:
    """The entry's manifest, or None when it is missing or unreadable."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
        if data.get("version") != MANIFEST_VERSION:
            return None
        return Manifest(data["files"], float(data["built"]), bool(data.get("verified")), data.get("meta"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_manifest(folder: Path, manifest: Manifest) -> None:
    data = {"version": MANIFEST_VERSION, "files": manifest.files, "built": manifest.built,
            "verified": manifest.verified, "meta": manifest.meta}  # fmt: skip
    staged = folder / f".{MANIFEST}.tmp"
    staged.write_text(json.dumps(data, indent=1, sort_keys=True))
    staged.replace(folder / MANIFEST)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST)


def problem(folder: Path, checksums: bool | None = None) -> str | None:
    """Why the entry at ``folder`` cannot be used (missing, no manifest, a file missing or of another size, a
    checksum that differs), or None if it can. Sizes are always checked; checksums when ``checksums`` is True,
    or (None) when the entry was never verified since its build or a size differs. A first verification that
    passes is recorded in the manifest."""
    if not folder.is_dir():
        return "missing"
    manifest = read_manifest(folder)
    if manifest is None:
        return f"no readable {MANIFEST}"
    for name, item in manifest.files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != item["size"]:
            return f"{name} is {size:,} bytes, {item['size']:,} when built"
    if checksums or (checksums is None and not manifest.verified):
        for name, item in manifest.files.items():
            if _sha256(folder / name) != item["sha256"]:
                return f"{name} differs from what was built (checksum)"
        if not manifest.verified:
            with suppress(OSError):  # a read-only cache: verified again next time
                _write_manifest(folder, Manifest(manifest.files, manifest.built, True, manifest.meta))
    return None


def touch(folder: Path) -> None:
    """Record a use of the entry now (the manifest's modification time)."""
    with suppress(OSError):
        os.utime(folder / MANIFEST)


def write_entry(
    folder: Path, write: Callable[[Path], None], meta: dict[str, Any] | None = None, expected: int = 0
) -> None:
    """Call ``write(staging)`` on a new folder beside ``folder``, record its manifest, then rename it into place
    (replacing a damaged entry). A full disk or a folder we may not write raises ``CacheFull`` (``expected``: the
    entry's usual size in bytes, for its message); either way nothing half-written is left behind."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=STAGING_PREFIX))
    try:
        write(staging)
        files = {
            str(path.relative_to(staging)): {"size": path.stat().st_size, "sha256": _sha256(path)}
            for path in _files(staging)
        }
        _write_manifest(staging, Manifest(files, time.time(), False, meta))  # verified at its first use
        _replace(staging, folder)
    except OSError as error:
        written = _size(staging)
        shutil.rmtree(staging, ignore_errors=True)
        if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise _full(folder, max(written, expected), error) from None
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_file(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (a staging file beside it, renamed over it): readers see the old file or the new
    one, never part of it. A full disk or a folder we may not write raises ``CacheFull``, the staging file removed."""
    path = Path(path)
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        staged.write_bytes(data)
        staged.replace(path)
    except OSError as error:
        staged.unlink(missing_ok=True)
        if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise _full(path, len(data), error) from None
        raise


def _replace(staging: Path, folder: Path) -> None:
    """Rename ``staging`` to ``folder``; an entry already there is moved aside first and deleted (a process that
    has its files open or mapped keeps reading them: nothing is rewritten in place)."""
    if folder.exists():
        trash = Path(tempfile.mkdtemp(dir=folder.parent, prefix=TRASH_PREFIX))
        folder.rename(trash / folder.name)
        staging.rename(folder)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(folder)


def _size(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def _full(folder: Path, needed: int, error: OSError) -> CacheFull:
    """One line: which folder could not take the entry, why, and how many bytes it needs (its usual size, or those
    written before the failure if more) against those free."""
    try:
        free = shutil.disk_usage(folder.parent).free
    except OSError:
        free = 0
    reason = os.strerror(error.errno) if error.errno else str(error)
    return CacheFull(
        error.errno or errno.ENOSPC,
        f"cannot write {folder.name} in {folder.parent} ({reason.lower()}): it needs at least "
        f"{_mb(needed)} ({needed:,} bytes), {_mb(free)} free; free some space "
        "(`specdecode cache clean`) or point SPECDECODE_CACHE elsewhere",
    )


def _mb(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def ensure_entry(
    folder: Path,
    what: str,
    write: Callable[[Path], None],
    meta: dict[str, Any] | None = None,
    adopt: Callable[[Path], bool] | None = None,
    expected: int = 0,
) -> Path:
    """``folder``, a usable cache entry: checked (``problem``) and, if missing or damaged, (re)built by
    ``write(staging)`` under the entry's lock, a damaged one with one warning line. ``adopt``: whether an entry
    without a manifest (an older specdecode's) is whole, to keep it (its manifest is written) rather than rebuild."""
    reason = problem(folder)
    if reason is None:
        touch(folder)
        return folder
    with exclusive(lock_of(folder), what):
        reason = problem(folder)  # another process may have built it while we waited
        if reason is None:
            return folder
        if reason.startswith("no readable") and adopt is not None and _adopted(folder, adopt, meta):
            return folder
        if reason != "missing":
            print(f"specdecode: warning: the cache entry {folder} is damaged ({reason}); rebuilding it",
                  file=sys.stderr, flush=True)  # fmt: skip
        write_entry(folder, write, meta, expected)
    return folder


def _adopted(folder: Path, whole: Callable[[Path], bool], meta: dict[str, Any] | None) -> bool:
    """Give an older specdecode's entry a manifest if ``whole(folder)`` says it is complete."""
    if not whole(folder):
        return False
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(folder)}
    try:
        _write_manifest(folder, Manifest(files, folder.stat().st_mtime, True, meta))
    except OSError:
        return False
    return True


def source_meta(source: Path) -> dict[str, Any]:
    """An entry made from the file ``source``: its path, size and modification time (stale once they change)."""
    stat = source.stat()
    return {"source": str(source.resolve()), "source_size": stat.st_size, "source_mtime": int(stat.st_mtime)}


def whole_safetensors(path: Path) -> bool:
    """Whether a safetensors file holds every byte its header promises (a copy cut short does not)."""
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        ends = [int(item["data_offsets"][1]) for key, item in header.items() if key != "__metadata__"]
        return path.stat().st_size >= 8 + length + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False


def whole_hf_folder(folder: Path) -> bool:
    """Whether an older specdecode's model folder (no manifest) is whole: a config, every safetensors file whole."""
    return (folder / "config.json").is_file() and all(whole_safetensors(p) for p in folder.glob("*.safetensors"))


@dataclass(frozen=True)
class Entry:
    """One cache entry, as ``specdecode cache`` lists it: its folder, kind (``kernels``, ``dense``, ``gguf``), size,
    last use, what it was built for, and why it cannot be used (None if it can: sizes checked only)."""

    folder: Path
    kind: str
    size: int
    last_used: float
    meta: dict[str, Any]
    problem: str | None


def entries(root: Path | None = None) -> list[Entry]:
    """Every entry under the cache (a folder of ``kernels/``, ``dense/``, ``gguf/``), and leftovers of interrupted
    writes (staging folders), oldest use first."""
    root = cache_root() if root is None else root
    found: list[Entry] = []
    for kind_folder in sorted(p for p in root.glob("*") if p.is_dir()):
        for path in sorted(kind_folder.iterdir()):
            if path.is_file() and not path.name.endswith(".lock"):  # a one-file entry (synthetic models)
                found.append(Entry(path, kind_folder.name, path.stat().st_size, path.stat().st_mtime, {}, None))
            if not path.is_dir():
                continue
            folder = path
            manifest = read_manifest(folder)
            leftover = folder.name.startswith((STAGING_PREFIX, TRASH_PREFIX))
            reason = "an interrupted write" if leftover else problem(folder, checksums=False)
            if manifest is None and not leftover:  # an older specdecode's entry: checked (adopted) at its next use
                reason, meta = None, {"unchecked": True}
            else:
                meta = (manifest.meta if manifest is not None else None) or {}
            used = (folder / MANIFEST).stat().st_mtime if manifest is not None else folder.stat().st_mtime
            found.append(Entry(folder, kind_folder.name, _size(folder), used, meta, reason))
    return sorted(found, key=lambda entry: entry.last_used)


def remove(entry: Entry) -> None:
    """Delete an entry (its lock file too); a process using its files keeps reading them."""
    with exclusive(lock_of(entry.folder), f"removing {entry.folder.name}"):
        if entry.folder.is_dir():
            shutil.rmtree(entry.folder, ignore_errors=True)
        else:
            entry.folder.unlink(missing_ok=True)
    lock_of(entry.folder).unlink(missing_ok=True)
