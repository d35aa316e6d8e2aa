"""Our CPU kernels (C++ in ``csrc/``), compiled on this machine on first use and cached; or None where they can't be.

``ops()`` returns the loaded operator namespace (``torch.ops.specdecode_kernels``) or None. The first call compiles
the sources, one translation unit (``csrc/ops.cpp``, which includes the other parts in order), with this machine's
g++ for its own CPU (``-march=native``: AVX-512 with VNNI, AVX2, or plain C, the same numerics in each), with one
line on stderr while it does, and caches the library under ``cache_root()/kernels/<variant>-<key>`` where the key
names every file of ``csrc/``, the compiler, torch and the CPU's flags, so each CPU/compiler builds once: an entry
of ``disk_cache``, written whole, checked before it is loaded and rebuilt if damaged (a library cut short would die
with a bus error when loaded). It links torch's own OpenMP runtime, so the kernels run on torch's thread pool.
``SPECDECODE_KERNELS=0`` turns them off (the pure-torch formats of ``models.formats.weights`` run instead, as they
do when the build fails: one warning line says why); ``=avx2`` or ``=portable`` runs another instruction set's build
(portable: the tests' plain-C reference, built at -O1, not for speed). The mutant builds (``MUTANTS``, the exactness
tests' controls) are refused outside the tests.
"""

from __future__ import annotations

import errno
import hashlib
import math
import mmap
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from ..disk_cache import cache_root, ensure_entry

SOURCES = Path(__file__).with_name("csrc")  # every file here is part of the build (and of its cache key)
SOURCE = SOURCES / "ops.cpp"  # the one translation unit: it includes the other parts
NAMESPACE = "specdecode_kernels"
# Build variants: the native one the runner uses, and portable ones the tests compare it with bitwise. The plain-C
# reference builds at -O1 (the flag after -O3 wins): g++ took 132 s at -O3 vectorizing its lane loops, 30 s at -O1
# (a 2-core Zen 3), and the optimization level changes no result (IEEE operations, -ffp-contract=off).
_PORTABLE = ["-O1", "-DSD_PORTABLE"]
VARIANTS = {
    "native": ["-march=native"],
    "avx2": ["-march=haswell"],
    "portable": ["-march=x86-64", *_PORTABLE] if platform.machine() == "x86_64" else _PORTABLE,
}
# Mutant builds, for the exactness tests' controls only: the native build with one deliberate fault in the compiled
# sampling (sampling.h), which every law test must catch when handed these ops (or the runner, SPECDECODE_KERNELS).
# They draw a biased law, so ``ops`` and ``SPECDECODE_KERNELS`` refuse them unless the test suite's switch is on
# (``_mutants_allowed``: set by tests/conftest.py's ``mutant_builds`` fixture, never by the library).
MUTANTS = {
    "mutant_residual": ["-march=native", "-DSD_MUTANT_RESIDUAL"],  # 1% of p mixed into max(0, p - q)
    "mutant_index": ["-march=native", "-DSD_MUTANT_INDEX"],  # every inverse-CDF draw one index off
    "mutant_accept": ["-march=native", "-DSD_MUTANT_ACCEPT"],  # accept iff u <= p/q (not <)
    "mutant_point_mass": ["-march=native", "-DSD_MUTANT_POINT_MASS"],  # a point mass's residual keeps the guess
    "mutant_eps": ["-march=native", "-DSD_MUTANT_EPS"],  # residuals of mass <= 1e-3 (not 1e-12) fall back to p
    "mutant_block": ["-march=native", "-DSD_MUTANT_BLOCK"],  # draws never reach a last block of < 64 entries
}
VARIANTS |= MUTANTS
LIBRARY_BYTES = 1 << 20  # a built library's size, about (0.65 MB with g++ 13): what a full disk's message asks for
_mutants_allowed = False
_lock = threading.Lock()
_loaded: dict[str, SimpleNamespace | None] = {}


OFF = ("0", "false", "no", "off")


def runner_variant() -> str | None:
    """The build models loaded now run on: ``SPECDECODE_KERNELS`` = 0 (off: the pure-torch path), avx2 or
    portable (another instruction set's build, to compare it on this machine), else native. A mutant (``MUTANTS``)
    raises ValueError: it is a test's control, biased on purpose."""
    value = os.environ.get("SPECDECODE_KERNELS", "native").strip().lower()
    if value in OFF:
        return None
    return refuse_mutant(value) if value in VARIANTS else "native"


def refuse_mutant(variant: str) -> str:
    """``variant``, unless it is a mutant build outside the test suite (ValueError: it samples a biased law)."""
    if variant in MUTANTS and not _mutants_allowed:
        raise ValueError(
            f"SPECDECODE_KERNELS={variant} is a deliberately biased build of the kernels, a control for the exactness "
            "tests only; unset SPECDECODE_KERNELS (or set it to 0, avx2 or portable)"
        )
    return variant


HUGE_PAGE = 1 << 21


def streamed_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor for memory every step reads whole (weight tiles): from 2 MiB on, its own anonymous mapping,
    aligned to and advised onto 2 MiB pages where the OS does that (Linux's transparent huge pages on request), so
    streaming ~1 GB of weights walks a page-table entry per 2 MiB instead of per 4 KiB (the 1.5B's one-token step
    32.2 → 26.5 ms on a Zen 4). Elsewhere, or smaller: ``torch.zeros``. The tensor's storage is exactly its bytes."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeroed, untouched
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)  # holds the mapping
    return flat.view(dtype).view(shape)


def ops(variant: str | None = None) -> SimpleNamespace | None:
    """The kernels' operators for ``variant`` (built and loaded once per process), or None if unavailable;
    by default the build a model loaded now should run on (``runner_variant``; None when turned off)."""
    variant = variant or runner_variant()
    if variant is None:
        return None
    refuse_mutant(variant)
    with _lock:
        if variant not in _loaded:
            _loaded[variant] = _load(variant)
        return _loaded[variant]


def _load(variant: str) -> SimpleNamespace | None:
    try:
        library = build(variant)
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        if variant == runner_variant():
            warnings.warn(
                f"specdecode: CPU kernels unavailable ({error}); running the slower pure-torch path",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    torch.ops.load_library(str(library))
    return getattr(torch.ops, _namespace(variant))


def _namespace(variant: str) -> str:
    return NAMESPACE if variant == "native" else f"{NAMESPACE}_{variant}"


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "g++"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _command(variant: str, output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    include = torch_dir / "include"
    lib = torch_dir / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        _compiler(), "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden",
        *VARIANTS[variant], f"-DSD_NS={_namespace(variant)}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE), "-o", str(output),
        f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch",
    ]  # fmt: skip


def _compiler_version() -> str:
    return subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=True).stdout


def _key(variant: str) -> str:
    flags = " ".join(VARIANTS[variant])
    sources = [f"{path.name}\n{path.read_text()}" for path in sorted(SOURCES.iterdir()) if path.is_file()]
    parts = [*sources, variant, _compiler_version(), torch.__version__, _cpu_flags(), flags]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def built_for(variant: str) -> dict[str, str]:
    """What a build of ``variant`` here is for (its cache entry's manifest ``meta``; ``specdecode cache`` calls
    an entry whose torch, compiler or key differs stale)."""
    compiler = (_compiler_version().splitlines() or [""])[0]
    return {"variant": variant, "key": _key(variant), "torch": torch.__version__, "compiler": compiler}


def build(variant: str = "native") -> Path:
    """The compiled library for ``variant``, built now unless the cache holds it whole (one build at a time per
    key; a damaged library, e.g. cut short by a full disk, is rebuilt with one warning line, never loaded)."""
    meta = built_for(refuse_mutant(variant))
    folder = cache_root() / "kernels" / f"{variant}-{meta['key']}"
    name = f"{_namespace(variant)}.so"

    def compile_into(staging: Path) -> None:
        print(f"specdecode: compiling the CPU kernels for this machine ({variant}, once, ~30 s) ...",
              file=sys.stderr, flush=True)  # fmt: skip
        result = subprocess.run(_command(variant, staging / name), capture_output=True, text=True)
        if result.returncode != 0:
            if "No space left on device" in result.stderr:
                raise OSError(errno.ENOSPC, "No space left on device")
            lines = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
            raise RuntimeError(f"g++ failed: {(lines or ['no output'])[0].strip()}")

    what = f"compiling the CPU kernels ({variant})"
    ensure_entry(folder, what, compile_into, meta, adopt=lambda f: whole_elf(f / name), expected=LIBRARY_BYTES)
    return folder / name


def whole_elf(path: Path) -> bool:
    """Whether ``path`` is an ELF file as long as its header says (the section table ends the file): a library
    cut short is not, and loading one dies with a bus error."""
    try:
        with open(path, "rb") as handle:
            header = handle.read(64)
        size = path.stat().st_size
    except OSError:
        return False
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:  # ELF64 only (what g++ builds here)
        return False
    order = "little" if header[5] == 1 else "big"
    table = int.from_bytes(header[0x28:0x30], order)
    entry_size, count = int.from_bytes(header[0x3A:0x3C], order), int.from_bytes(header[0x3C:0x3E], order)
    return table > 0 and table + entry_size * count <= size
