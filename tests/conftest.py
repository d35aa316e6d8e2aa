"""Fixtures and session settings for the suite; the helpers they wrap live in the ``helpers`` package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.kernels import kernels_or_skip
from helpers.models import LARGE_VOCAB, SMALL_VOCAB, perturbed, tiny_llama

import specdecode as sd
from specdecode import kernels

torch.set_num_threads(1)  # one core a test: `pytest -n auto` (pytest-xdist) runs one worker a core

# Rich wraps at the console's width, read from COLUMNS (and LINES) when a console is made, so an assertion on a
# phrase printed next to a tmp path failed once the path grew (pytest-99 -> pytest-100). The command modules'
# shared console is made when a test module imports them, and pytest-xdist starts its workers with COLUMNS=80 and
# LINES=24, which would fix it at 80 columns: every console made from here on is 400 columns wide.
os.environ["COLUMNS"] = "400"
os.environ.pop("LINES", None)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's default): one worker per core this process may use (each test runs on one torch
    thread), and at most one per 4 GiB of memory (a worker's peak, measured: 2.6 GiB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores, memory // (4 << 30)))


def pytest_runtest_setup(item) -> None:
    """A test marked ``needs_kernels`` skips where the compiled kernels do not build, or fails where they must
    (``SPECDECODE_REQUIRE_KERNELS=1``: helpers/kernels.py); it skips where ``SPECDECODE_KERNELS=0`` turns them off
    (the fallback's run: the tests that hold on either path ask ``runs_kernels()`` instead)."""
    if item.get_closest_marker("needs_kernels") is not None:
        if kernels.runner_variant() is None:
            pytest.skip("SPECDECODE_KERNELS=0: the compiled kernels are turned off")
        kernels_or_skip()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh ``SPECDECODE_CACHE`` under the test's tmp_path (returned), and no ``$SPECDECODE_AVAILABLE_MEMORY``
    override: what a first load on a new machine sees."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(folder))
    monkeypatch.delenv("SPECDECODE_AVAILABLE_MEMORY", raising=False)
    return folder


@pytest.fixture(scope="session", params=["native", "transformers"])
def backend(request) -> str:
    """Every test on the tiny models runs on both runners: ours (native) and transformers'."""
    return request.param


@pytest.fixture(scope="session")
def small_target(backend: str) -> sd.LoadedModel:
    """Vocabulary 16: small enough to enumerate the joint law of two tokens (256 cells)."""
    return sd.load_model(tiny_llama(SMALL_VOCAB, seed=0), backend=backend)


@pytest.fixture(scope="session")
def small_draft(small_target: sd.LoadedModel, backend: str) -> sd.LoadedModel:
    """The small target plus strong noise: per-token acceptance ≈ 0.5 at temperature 1."""
    return sd.load_model(perturbed(small_target.model, seed=1, noise=0.15), backend=backend)


@pytest.fixture(scope="session")
def large_target(backend: str) -> sd.LoadedModel:
    """Vocabulary 64, for greedy identity over longer outputs."""
    return sd.load_model(tiny_llama(LARGE_VOCAB, seed=10), backend=backend)


@pytest.fixture(scope="session")
def large_draft(large_target: sd.LoadedModel, backend: str) -> sd.LoadedModel:
    """The large target plus mild noise: its greedy guesses are right about half the time."""
    return sd.load_model(perturbed(large_target.model, seed=11, noise=0.06), backend=backend)
