"""Row invariance at the sizes the server runs: a batched verify pass of up to 16 requests x (gamma 8 + 1) = 144
rows, and single passes of 33..144 rows, bitwise equal to each request's own one-token steps, in every weight
format and dtype, with mixed cache lengths (inside and across the kernels' 128-key attention chunks).

The tests of tests/models/native/test_native_llama.py stop at 32 rows; the kernels block rows in groups, so sizes past
32 are where a row's arithmetic could start to depend on its neighbours.
"""

from __future__ import annotations

import pytest
import torch
from helpers.native import SETTING_NAMES, SETTINGS, gemma3, loaded_as, random_ids, wide_llama

REQUESTS, ROWS_PER_REQUEST = 16, 9  # the server's defaults: max_batch 16, max_gamma 8 (+ the bonus row)
MODELS = {"llama": wide_llama, "gemma3": gemma3}


def _single_steps(runner, context: list[int], tokens: list[int]) -> torch.Tensor:
    runner.reset()
    runner.prefill(torch.tensor(context))
    return torch.cat([runner.forward(torch.tensor([t])) for t in tokens])


def _assert_batch_is_each_requests_own(target, ids: list[int], lengths: list[int], first_chunk: int) -> None:
    """REQUESTS runners with caches of ``lengths`` (contexts taken from ``ids``), one 144-row batched pass of
    ROWS_PER_REQUEST tokens each (from ``ids[first_chunk:]``): every request's logits bitwise its own steps.
    Each runner takes its own steps first and is rolled back to its context for the batch (one prefill each)."""
    assert len(lengths) == REQUESTS and len(ids) >= first_chunk + REQUESTS * ROWS_PER_REQUEST
    contexts = [ids[i : i + n] for i, n in enumerate(lengths)]
    starts = [first_chunk + ROWS_PER_REQUEST * i for i in range(REQUESTS)]
    chunks = [ids[s : s + ROWS_PER_REQUEST] for s in starts]
    batch = [target.new_runner() for _ in contexts]
    alone = []
    for runner, context, chunk in zip(batch, contexts, chunks, strict=True):
        alone.append(_single_steps(runner, context, chunk))
        runner.rollback_to(len(context))
    together = batch[0].forward_batch(batch, [torch.tensor(c) for c in chunks])
    assert sum(t.shape[0] for t in together) == REQUESTS * ROWS_PER_REQUEST
    for index, (context, steps, logits) in enumerate(zip(contexts, alone, together, strict=True)):
        assert torch.equal(logits, steps), f"request {index} (cache {len(context)})"


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize(SETTING_NAMES, SETTINGS)
def test_a_144_row_batch_gives_each_request_its_own_steps_bitwise(family, dtype, quantization, group_size, kernels):
    target = loaded_as(MODELS[family](), dtype, quantization, group_size, kernels)
    lengths = [1, 3, 15, 16, 17, 31, 64, 100, 127, 128, 129, 200, 255, 256, 300, 400]  # around tile/chunk edges
    _assert_batch_is_each_requests_own(target, random_ids(700, seed=11), lengths, 500)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize(SETTING_NAMES, SETTINGS)
def test_single_passes_of_33_to_144_rows_are_bitwise_single_steps(family, dtype, quantization, group_size, kernels):
    runner = loaded_as(MODELS[family](), dtype, quantization, group_size, kernels).new_runner()
    ids = random_ids(400, seed=12)
    context = ids[:120]  # the pass crosses the 128-key chunk edge
    steps = _single_steps(runner, context, ids[120:264])
    for k in (33, 48, 64, 97, 144):
        runner.reset()
        runner.prefill(torch.tensor(context))
        together = runner.forward(torch.tensor(ids[120 : 120 + k]))
        assert torch.equal(together, steps[:k]), f"k = {k}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "quantization", "dtype"),
    [("smollm2", "gguf", "float32"), ("smollm2", "gguf-a8", "float32"), ("smollm2", None, "bfloat16"),
     ("gemma3-270m", "gguf", "float32")],
)  # fmt: skip
def test_the_bundled_models_144_row_batch_is_each_requests_own_steps(name, quantization, dtype):
    import importlib.util

    import specdecode as sd
    from specdecode.models.loading.bundled import BUNDLED

    if importlib.util.find_spec(BUNDLED[name].package) is None:
        pytest.skip(BUNDLED[name].install)
    target = sd.load_model(name, quantization=quantization, dtype=dtype)
    ids = target.encode(" ".join(f"Line {i}: the tide came in at {i % 12} o'clock." for i in range(120)))
    lengths = [1, 5, 16, 17, 40, 64, 100, 127, 128, 129, 180, 256, 300, 384, 450, 520]
    _assert_batch_is_each_requests_own(target, ids, lengths, 600)
