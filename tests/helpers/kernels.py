"""The compiled kernels in tests: a test that needs them skips where they do not build (a user's machine still runs
everything else), and fails instead where ``SPECDECODE_REQUIRE_KERNELS=1`` (CI sets it in .ci/run): a broken build
must not pass as a suite of skips."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import NoReturn

import pytest

from specdecode import kernels

REQUIRED = os.environ.get("SPECDECODE_REQUIRE_KERNELS") == "1"
needs_kernels = pytest.mark.needs_kernels  # conftest.py calls kernels_or_skip() before each marked test


def unavailable(reason: str) -> NoReturn:
    """Skip for ``reason`` (the kernels did not build here), or fail where they are required."""
    if REQUIRED:
        pytest.fail(f"{reason}; SPECDECODE_REQUIRE_KERNELS=1 requires them")
    pytest.skip(reason)


def kernels_or_skip(variant: str = "native"):
    """The ``variant`` build's ops; a test without them skips (``unavailable``). A CPU without AVX2 skips the AVX2
    build's tests on every machine: that is the CPU, not the build."""
    if variant == "avx2" and (platform.machine() != "x86_64" or "avx2" not in Path("/proc/cpuinfo").read_text()):
        pytest.skip("this CPU has no AVX2")
    ops = kernels.ops(variant)
    if ops is None:
        unavailable("the CPU kernels did not build here" if variant == "native" else f"the {variant} build failed here")
    return ops


def runs_kernels() -> bool:
    """Whether a model loaded now must run on the compiled kernels: False where ``SPECDECODE_KERNELS=0`` turns them
    off (the fallback's own run of the runner and GGUF tests, .ci/run), else True once the native build is there
    (``kernels_or_skip``: a test skips or fails without it)."""
    if kernels.runner_variant() is None:
        return False
    kernels_or_skip()
    return True


def mutant_build(variant: str, monkeypatch):
    """The ops of the mutant build ``variant`` (``kernels.MUTANTS``: a control), allowed for this test only (the
    library refuses them elsewhere: ``kernels._mutants_allowed``). Where the native build fails the test skips
    (``unavailable``) with the laws it controls; where the native build exists and the mutant does not, it fails:
    a control can fail but never vanish."""
    assert variant in kernels.MUTANTS, variant
    monkeypatch.setattr(kernels, "_mutants_allowed", True)
    kernels_or_skip("native")
    ops = kernels.ops(variant)
    if ops is None:
        pytest.fail(f"the native kernels build here but the {variant} build does not: its controls would vanish")
    return ops


def use_build(variant: str, monkeypatch):
    """Run the kernels of ``variant`` (native or a mutant build) from here on, as ``SPECDECODE_KERNELS`` selects a
    build; its ops."""
    ops = kernels_or_skip(variant) if variant not in kernels.MUTANTS else mutant_build(variant, monkeypatch)
    monkeypatch.setenv("SPECDECODE_KERNELS", variant)
    return ops
