"""Module fixtures several test modules import (pytest finds a fixture imported into a module): a head trained for
the word target, a target whose layer a self-draft skips."""

from __future__ import annotations

from pathlib import Path

import pytest

import specdecode as sd
from helpers.kernels import unavailable
from helpers.models import tiny_llama, train_word_head, weakened, word_target
from helpers.tokenizers import WORDS
from specdecode import kernels


@pytest.fixture(scope="module")
def skip_target() -> sd.LoadedModel:
    """Four layers, the second one's residual writes at 60%: skipping it drafts what the target accepts ~70% of the
    time (measured 0.71 below), so both acceptance and rejection carry mass."""
    if kernels.ops("native") is None:
        unavailable("the CPU kernels did not build here")
    return sd.load_model(weakened(tiny_llama(16, seed=0, num_layers=4), {1}, 0.6))


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> Path:
    """A head trained briefly for ``large_target`` (same weights: tiny_llama(64, seed=10)) on its own samples."""
    return train_word_head(word_target(), WORDS, tmp_path_factory, "eagle-head")
