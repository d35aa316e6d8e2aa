"""Could a cheaper first pass over gemma3-270m's 262,144-row Q8_0 head prove the argmax without the full head?
Re-quantize the head to BITS (6, 5, 4, 3) per block of 32 and bound each logit's error three ways — Hölder per
block Σ_b max|e_b|·‖h_b‖₁, Cauchy–Schwarz per block Σ_b ‖e_b‖₂·‖h_b‖₂ and per row ‖e‖₂·‖h‖₂ (worst cases: what
a proof needs); count the rows each bound cannot exclude for the argmax and for the top 32, on the final-norm
states of a real greedy answer, next to the actual error.

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
        f"| bits | bound | mean bound (logits) | argmax candidates: median / max | top-32 candidates: median "
        f"| of {vocab:,} |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    h_blocks = h.view(ROWS, blocks, -1)
    for bits in (6, 5, 4, 3):
        top = 2 ** (bits - 1) - 1
        step = weights.abs().amax(-1, keepdim=True) / top
        screened = torch.round(weights / step.clamp_min(1e-30)).clamp(-top - 1, top) * step
        difference = weights - screened  # [V, blocks, 32]
        bounds = {
            # Hölder per block: Σ_b max|e_b| · ‖h_b‖₁
            "max·L1": h_blocks.abs().sum(-1) @ difference.abs().amax(-1).T,
            # Cauchy–Schwarz per block: Σ_b ‖e_b‖₂ · ‖h_b‖₂ (a [V, blocks] table of the errors' norms)
            "L2·L2 per block": h_blocks.norm(dim=-1) @ difference.norm(dim=-1).T,
            # Cauchy–Schwarz per row: ‖e_row‖₂ · ‖h‖₂ (one number per row)
            "L2·L2 per row": h.norm(dim=-1, keepdim=True) * difference.view(vocab, hidden).norm(dim=-1)[None, :],
        }
        screen = h @ screened.view(vocab, hidden).T
        for name, bound in bounds.items():
            assert bool(((exact - screen).abs() <= bound + 1e-3).all())  # the bound holds
            lower = screen - bound
            argmax = (screen + bound >= lower.max(-1, keepdim=True).values).sum(-1).float()
            top32 = (screen + bound >= torch.topk(lower, 32, -1).values[:, -1:]).sum(-1).float()
            print(
                f"| {bits} | {name} | {bound.mean():.2f} | {argmax.median():,.0f} / {argmax.max():,.0f} | "
                f"{top32.median():,.0f} | {vocab:,} |"
            )
        actual = (exact - screen).abs()
        print(f"| {bits} | actual error | {actual.mean():.3f} (max {actual.max():.2f}) | | | |")


if __name__ == "__main__":
    main()
