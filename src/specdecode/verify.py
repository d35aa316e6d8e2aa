"""Acceptance rules: given the target's distributions over a drafted run, keep a prefix and add one token.

Pure functions over tensors; no model calls. ``speculative_sample`` is the rule of Leviathan et al. (2023)
and Chen et al. (2023): accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection draw from norm(max(0, p_i − q_i)); if all k are accepted draw a bonus token from p_k. Every
emitted token is then distributed exactly as the target's (warped) p.
"""

from __future__ import annotations

import torch

RESIDUAL_EPS = 1e-12


def speculative_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Return ``(n_accepted, next_token)`` for ``k`` drafted tokens.

    ``target_probs`` is ``[k+1, V]``; ``draft_probs`` is ``[k, V]`` or None for a point mass on each draft
    token (q_i(x_i) = 1). Token i is accepted iff u_i < p_i(x_i) / q_i(x_i) with u_i a float64 uniform from
    ``generator`` (strict, so p = 0 never passes; q_i(x_i) = 0 rejects). The next token is drawn from
    norm(max(0, p_n − q_n)) after a rejection at n (from p_n when that mass is ≤ eps), or from p_k (bonus).
    """
    k = int(draft_tokens.shape[0])
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs needs k+1 = {k + 1} rows, got {target_probs.shape[0]}")
    n_accepted = k
    if k:
        rows = torch.arange(k)
        p_x = target_probs[rows, draft_tokens].double()
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, draft_tokens].double()
        u = torch.rand(k, dtype=torch.float64, generator=generator)
        accepted = (q_x > 0) & (u < p_x / q_x.clamp_min(torch.finfo(torch.float64).tiny))
        rejected_at = torch.nonzero(~accepted)
        if rejected_at.numel():
            n_accepted = int(rejected_at[0, 0])
    p = target_probs[n_accepted].double()
    if n_accepted < k:
        if draft_probs is None:
            residual = p.clone()
            residual[draft_tokens[n_accepted]] = 0.0
        else:
            residual = (p - draft_probs[n_accepted].double()).clamp_min(0.0)
        if residual.sum() > RESIDUAL_EPS:
            p = residual
    next_token = int(torch.multinomial(p, 1, generator=generator))
    return n_accepted, next_token


def greedy_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy rule: accept while each draft token equals the target's argmax; then emit the argmax.

    ``target_logits`` (or probabilities) is ``[k+1, V]``; returns ``(n_accepted, next_token)``.
    """
    return coupled_verify(target_logits.argmax(dim=-1), draft_tokens)


def coupled_verify(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Seed-coupled rule: accept while draft token i equals the target's own token i; then emit that token.

    ``target_tokens`` ``[k+1]`` are the tokens plain decoding would emit after context + draft[:i] (the
    argmax, or Gumbel-max with noise keyed by (seed, position)); returns ``(n_accepted, next_token)``. Every
    emitted token equals the target's, so the output is plain decoding's, token for token.
    """
    k = int(draft_tokens.shape[0])
    mismatch = torch.nonzero(target_tokens[:k] != draft_tokens)
    n_accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return n_accepted, int(target_tokens[n_accepted])
