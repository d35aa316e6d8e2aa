"""Row invariance, its control, and the GGUF load paths (issue 53).

The bitwise check the row-invariance tests use (``helpers.native.assert_rows_equal_single_steps``: a k-token pass
after a context gives, row by row, ``torch.equal`` to one-token steps) must fail for a runner that rounds differently
for k rows — else the tests could not see the bug that breaks identity with plain decoding silently. The control
wraps the real native runner and changes only multi-row passes, by the least a kernel could: one ulp on one logit of
one row (k-dependent), or a sum reassociated (the logits recomputed as (x + c) − c, c = 2⁻⁴: bits move, values
barely). Then the same check runs on the GGUF load path (blocks straight from the file, helpers/gguf.py's
``write_gguf``) and on a Gemma-3-shaped GGUF (sandwich norms, q/k norms, a sliding window, the tied, scaled
embedding as head: helpers/architectures.py's ``write``), also at Gemma 3's 262,144-token vocabulary, at
k = 1..16 after contexts of 1, 9 and 50.
"""

from __future__ import annotations

import pytest
import torch
from helpers import architectures
from helpers.architectures import SPECS, write
from helpers.gguf import LAYOUTS, write_gguf
from helpers.kernels import runs_kernels
from helpers.native import assert_rows_equal_single_steps, loaded_as, random_ids, wide_llama

import specdecode as sd

CONTEXTS = (1, 9, 50)
CHUNKS = range(1, 17)


class RoundsByRowCount:
    """A runner whose multi-row passes round differently from its one-row steps (the bug row invariance forbids);
    everything else is the wrapped runner's."""

    def __init__(self, runner, how: str) -> None:
        self._runner, self._how = runner, how

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def forward(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
        logits = self._runner.forward(tokens, **kwargs)
        k = logits.shape[0]
        if k == 1:
            return logits
        logits = logits.clone()
        if self._how == "one-ulp":  # the last row, at a column that depends on k: the least a kernel could change
            column = k % logits.shape[1]
            logits[-1, column] = torch.nextafter(logits[-1, column], torch.tensor(float("inf")))
        else:  # "reassociated": (x + c) − c, as a sum taken in another order rounds
            logits = (logits + 0.0625) - 0.0625
        return logits


def _check_every_chunk(runner, ids: list[int]) -> None:
    for context in CONTEXTS:
        for k in CHUNKS:
            assert_rows_equal_single_steps(runner, ids[:context], ids[context : context + k])


@pytest.mark.parametrize("how", ["one-ulp", "reassociated"])
def test_control_a_runner_that_rounds_differently_for_k_rows_fails_the_bitwise_check(how):
    """The check catches a multi-row pass that differs from single steps by one ulp in one logit (and a reassociated
    sum); the unwrapped runner passes the same calls, so it is the wrapper, not the check, that fails."""
    runner = loaded_as(wide_llama(), "float32", "int8", 32, "kernels").new_runner()
    ids = random_ids(80, seed=5)
    _check_every_chunk(runner, ids)
    with pytest.raises(AssertionError, match="row"):
        _check_every_chunk(RoundsByRowCount(runner, how), ids)


GGUF_FILES = {
    "llama-mixed-blocks": lambda path: write_gguf(path, LAYOUTS["mixed"]),
    "llama-untied-q6k-head": lambda path: write_gguf(path, LAYOUTS["k-quants"], head="Q6_K"),
    "gemma3": lambda path: write(path, SPECS["gemma3"]),
    "gemma3-262144-vocab": lambda path: write(path, SPECS["gemma3"]),  # Gemma 3's own head width (a 74 MB file)
}


@pytest.mark.parametrize("name", list(GGUF_FILES))
def test_the_gguf_load_path_is_row_invariant_at_every_chunk(name, tmp_path, cache, monkeypatch):
    """A GGUF loaded from its own blocks (no dense copy) is bitwise row-invariant for k = 1..16 after contexts of
    1, 9 and 50 (past the Gemma file's sliding window), its head included — at Gemma 3's 262,144-token vocabulary
    too; and the control wrapper fails there as well."""
    if name.endswith("262144-vocab"):
        monkeypatch.setattr(architectures, "VOCAB", 262_144)
    loaded = sd.load_model(GGUF_FILES[name](tmp_path / f"{name}.gguf"))
    assert loaded.backend == "native" and loaded.quantization == "gguf"
    assert loaded.new_runner().uses_kernels is runs_kernels()
    runner = loaded.new_runner()
    ids = torch.randint(0, loaded.vocab_size, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        _check_every_chunk(runner, ids)
        with pytest.raises(AssertionError, match="row"):
            _check_every_chunk(RoundsByRowCount(runner, "one-ulp"), ids)
    if name.endswith("262144-vocab"):
        assert loaded.vocab_size == 262_144
