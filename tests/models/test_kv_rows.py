"""A reused prefix continues bitwise as a full prefill: the runner side of the prefix cache.

``prefill`` stores what one-token steps store (row invariance), so a cache assembled from a kept prefix, rows
copied from another runner (``export_rows`` / ``append_rows``), steps and partial prefills gives bitwise the
logits of a fresh full prefill — for every weight format, on the kernels and on the torch fallback. Controls:
one value row scaled in the copied rows, or rows of other tokens, change the logits.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import unavailable
from helpers.native import SETTINGS, loaded_as, random_ids, wide_llama


def _fresh_logits(loaded, ids: list[int]) -> torch.Tensor:
    runner = loaded.new_runner()
    runner.prefill(torch.tensor(ids[:-1]))
    return runner.forward(torch.tensor(ids[-1:]))


@pytest.fixture(scope="module", params=SETTINGS, ids=["-".join(map(str, s)) for s in SETTINGS])
def loaded(request):
    return loaded_as(wide_llama(), *request.param)


def test_a_kept_prefix_extended_by_steps_and_prefills_is_a_full_prefill(loaded):
    turn1, turn2 = random_ids(70, seed=2), random_ids(90, seed=3)
    runner = loaded.new_runner()
    runner.prefill(torch.tensor(turn1[:30]))  # a prompt, then answer steps and a speculative pass rolled back
    for token in turn1[30:50]:
        runner.forward(torch.tensor([token]))
    runner.forward(torch.tensor(turn1[50:70]))
    runner.rollback_to(61)
    full = turn1[:61] + turn2  # the next turn extends the first 61 tokens
    runner.prefill(torch.tensor(full[61:-1]))
    assert torch.equal(runner.forward(torch.tensor(full[-1:])), _fresh_logits(loaded, full))


@pytest.mark.parametrize("block", [16, 32])
def test_rows_copied_into_another_runner_continue_bitwise_even_when_the_hit_ends_mid_block(loaded, block):
    ids = random_ids(150, seed=4)
    source = loaded.new_runner()
    source.prefill(torch.tensor(ids[:45]))
    for token in ids[45:100]:
        source.forward(torch.tensor([token]))
    # a new prompt shares 83 tokens: whole blocks of `block` cover 64 or 80 of them; the rest is prefilled
    prompt = ids[:83] + random_ids(40, seed=5)
    covered = 83 // block * block
    target = loaded.new_runner()
    for start in range(0, covered, block):
        target.append_rows(source.export_rows(start, start + block))
    assert target.length == covered
    target.prefill(torch.tensor(prompt[covered:-1]))
    assert torch.equal(target.forward(torch.tensor(prompt[-1:])), _fresh_logits(loaded, prompt))


def test_control_one_scaled_row_or_other_tokens_rows_change_the_logits(loaded):
    ids, other = random_ids(80, seed=6), random_ids(80, seed=7)
    reference = _fresh_logits(loaded, ids)
    source = loaded.new_runner()
    source.prefill(torch.tensor(ids[:64]))
    rows = source.export_rows(0, 32)
    flipped = rows.values.clone()  # the first layer's value row of token 5, 1.5 times larger
    flipped[0, ..., 5, :] *= 1.5
    stranger = loaded.new_runner()
    stranger.prefill(torch.tensor(other[:32]))
    for copied in (type(rows)(rows.keys, flipped, rows.tokens), stranger.export_rows(0, 32)):
        target = loaded.new_runner()
        target.append_rows(copied)
        target.prefill(torch.tensor(ids[32:-1]))
        assert not torch.equal(target.forward(torch.tensor(ids[-1:])), reference)


def test_export_rows_refuses_what_it_cannot_copy(loaded):
    runner = loaded.new_runner()
    runner.prefill(torch.tensor(random_ids(20)))
    with pytest.raises(ValueError, match="outside"):
        runner.export_rows(0, 21)
    if runner.uses_kernels:
        with pytest.raises(ValueError, match="multiple of 16"):
            runner.export_rows(3, 19)


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
@pytest.mark.parametrize(
    ("dtype", "quantization", "kernels"), [("float32", None, "torch"), ("float32", "int8", "kernels")]
)
def test_copied_rows_continue_bitwise_on_gemma_and_qwen(family, dtype, quantization, kernels):
    """Sliding-window layers (Gemma 3: window 8, every prompt longer), query/key norms: the same contract."""
    from helpers.native import FAMILIES

    loaded = loaded_as(FAMILIES[family](), dtype, quantization, 32, kernels)
    ids = random_ids(100, seed=8)
    source = loaded.new_runner()
    source.prefill(torch.tensor(ids[:40]))
    for token in ids[40:70]:
        source.forward(torch.tensor([token]))
    target = loaded.new_runner()
    target.append_rows(source.export_rows(0, 32))
    target.append_rows(source.export_rows(32, 64))
    target.prefill(torch.tensor(ids[64:-1]))
    assert torch.equal(target.forward(torch.tensor(ids[-1:])), _fresh_logits(loaded, ids))


def test_copied_rows_continue_bitwise_on_a_gguf_files_own_blocks(tmp_path, cache):
    """The GGUF formats (the bundled models' default) on the kernels: the same contract."""
    from specdecode import kernels

    if kernels.ops("native") is None:
        unavailable("the CPU kernels did not build here")
    from helpers.gguf import LAYOUTS, VOCAB, write_gguf

    import specdecode as sd

    loaded = sd.load_model(write_gguf(tmp_path / "mixed.gguf", LAYOUTS["mixed"]))
    ids = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    source = loaded.new_runner()
    source.prefill(torch.tensor(ids[:20]))
    for token in ids[20:50]:
        source.forward(torch.tensor([token]))
    target = loaded.new_runner()
    target.append_rows(source.export_rows(0, 32))
    target.prefill(torch.tensor(ids[32:-1]))
    assert torch.equal(target.forward(torch.tensor(ids[-1:])), _fresh_logits(loaded, ids))
