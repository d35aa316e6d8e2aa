"""Could a cheaper first pass over gemma3-270m's 262,144-row Q8_0 head prove the argmax without the full head?
Re-quantize the head to BITS per block of 32 and bound each logit's error by Σ_blocks max|w − w_q| · ‖h_block‖₁
(the worst case: what a proof needs); count the rows the bound cannot exclude for the argmax and for the top 32,
on the final-norm states of a real greedy answer.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/head_screen_bound.py
"""

from __future__ import annotations

import torch

import specdecode as sd

ROWS = 40


def main() -> None:
    target = sd.load_model("gemma3-270m")
    ids = target.chat_prompt("Explain how a bicycle works, in a few paragraphs.")
    out = sd.autoregressive_generate(target, ids, sd.SamplingParams(max_new_tokens=ROWS))
    runner = target.new_runner()
    runner.capture_hidden = True
    runner.prefill(torch.tensor(ids + out.token_ids[:-1]))
    x = runner.hidden[-ROWS:].float()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + runner._eps) * runner._norm.float()
    exact_rows = runner._exact_head_rows
    scale = exact_rows.scale.float()
    vocab, hidden = exact_rows.q.shape
    blocks = scale.shape[1]
    weights = exact_rows.q.float().view(vocab, blocks, hidden // blocks) * scale[:, :, None]
    exact = h @ weights.view(vocab, hidden).T
    print(
        f"| bits | mean bound (logits) | argmax candidates: median / max | top-32 candidates: median | of {vocab:,} |"
    )
    print("| --- | --- | --- | --- | --- |")
    for bits in (4, 3):
        top = 2 ** (bits - 1) - 1
        step = weights.abs().amax(-1, keepdim=True) / top
        screened = torch.round(weights / step.clamp_min(1e-30)).clamp(-top - 1, top) * step
        error = (weights - screened).abs().amax(-1)  # [V, blocks]: each block's largest weight error
        bound = h.view(ROWS, blocks, -1).abs().sum(-1) @ error.T  # [rows, V]
        screen = h @ screened.view(vocab, hidden).T
        assert bool(((exact - screen).abs() <= bound + 1e-3).all())  # the bound holds
        lower = screen - bound
        argmax = (screen + bound >= lower.max(-1, keepdim=True).values).sum(-1).float()
        top32 = (screen + bound >= torch.topk(lower, 32, -1).values[:, -1:]).sum(-1).float()
        print(
            f"| {bits} | {bound.mean():.1f} | {argmax.median():,.0f} / {argmax.max():,.0f} | "
            f"{top32.median():,.0f} | {vocab:,} |"
        )


if __name__ == "__main__":
    main()
