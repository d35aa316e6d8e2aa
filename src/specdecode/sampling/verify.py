"""Acceptance rules: given the target's distributions over a drafted run or tree, keep a path and add one token.

Pure functions over tensors; no model calls. ``speculative_sample`` is the rule of Leviathan et al. (2023)
and Chen et al. (2023): accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection draw from norm(max(0, p_i − q_i)); if all k are accepted draw a bonus token from p_k. Every
emitted token is then distributed exactly as the target's (warped) p.

Token trees (``tree`` for the layout: target row 0 is the context's newest token, row i + 1 is node i).
``tree_greedy_verify`` and ``tree_coupled_verify`` walk from the root along the child whose token is the
target's own token at the current row. ``tree_speculative_sample`` is recursive rejection sampling over
siblings (SpecInfer, Miao et al. 2024; EAGLE's multi-candidate rule): at a node with residual r = p, try its
children x_1, x_2, … (drawn from q without replacement) in order: accept x_i iff u < r(x_i) / q_i(x_i), where
q_i is q with x_1..x_{i−1} removed and renormalised; on rejection r ← norm(max(0, r − q_i)). An accepted
child becomes the node (r = its p); when every child fails, the next token is drawn from r.

Why that is exactly p. Given x_1..x_{i−1}, x_i ~ q_i (sampling without replacement), and r_{i+1} depends on
x_1..x_{i−1} only, not on x_i. Suppose what follows a rejection at i is distributed as r_{i+1} (true after
the last sibling: a draw from r_{m+1}). Then P(emit y) = q_i(y) min(1, r_i(y)/q_i(y)) + P(reject) r_{i+1}(y)
= min(q_i, r_i)(y) + max(0, r_i − q_i)(y) = r_i(y), since P(reject) = Σ max(0, r_i − q_i) is r_{i+1}'s
normaliser. By induction from the last sibling back, the token emitted at the node follows r_1 = p; the
node's subtree is drafted given its path, so the same holds one level down. Point masses (``probs`` None,
distinct deterministic candidates) are q_i = δ_{x_i}: accept iff u < r(x_i); on rejection r ← r with x_i
zeroed, renormalised. A single child per node is the chain rule.
"""

from __future__ import annotations

import torch

from .choices import NO_MASS, Choices, UniformsChoices, as_choices
from .probs import greedy_tokens
from .tree import children

RESIDUAL_EPS = 1e-12


def _residual(target: torch.Tensor, draft: torch.Tensor | None, token: int) -> torch.Tensor:
    """max(0, p − q) (unnormalised) after rejecting ``token`` drawn from q (δ_token if ``draft`` is None);
    ``target`` itself when that mass is ≤ eps (p == q: a rejection that had probability ~0)."""
    if draft is None:
        residual = target.clone()
        residual[token] = 0.0
    else:
        residual = (target - draft).clamp_min(0.0)
    return residual if residual.sum() > RESIDUAL_EPS else target


def speculative_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | Choices,
) -> tuple[int, int]:
    """Return ``(n_accepted, next_token)`` for ``k`` drafted tokens.

    ``target_probs`` is ``[k+1, V]``; ``draft_probs`` is ``[k, V]`` or None for a point mass on each draft
    token (q_i(x_i) = 1). Token i is accepted iff u_i < p_i(x_i) / q_i(x_i) with u_i a float64 uniform from
    ``generator`` (strict, so p = 0 never passes; q_i(x_i) = 0 rejects). The next token is drawn from
    norm(max(0, p_n − q_n)) after a rejection at n (from p_n when that mass is ≤ eps), or from p_k (bonus).
    ``generator`` may also be any ``choices.Choices`` (``exactness.enumerate_law`` enumerates the decisions).
    With a generator (or any ``choices.UniformsChoices``), float32 CPU rows and the CPU kernels, the rule runs as
    one call (``exact_chain``: ~20 µs against ~160 µs of torch ops at V = 49,152) fed the same uniforms in the same
    order, so a seed gives the same result on either path (to float64 rounding of the cumulative sums).
    """
    k = int(draft_tokens.shape[0])
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs needs k+1 = {k + 1} rows, got {target_probs.shape[0]}")
    choices = as_choices(generator)
    kernels = _chain_kernels(target_probs, draft_probs) if isinstance(choices, UniformsChoices) else None
    if kernels is not None:  # the same rule in one call, with the same uniforms drawn in the same order
        guesses = draft_tokens.long()

        def rule(accept_u: torch.Tensor, draw_u: float):
            return kernels.exact_chain(target_probs, draft_probs, guesses, accept_u, draw_u)

        n_accepted, token = choices.chain(rule, draft_tokens.tolist())
        if token < 0:
            raise ValueError(NO_MASS)
        return n_accepted, token
    n_accepted = k
    if k:
        rows = torch.arange(k)
        p_x = target_probs[rows, draft_tokens].double()
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, draft_tokens].double()
        ratios = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
        n_accepted = choices.accept_run(ratios, draft_tokens.tolist())
    p = target_probs[n_accepted].double()
    if n_accepted < k:
        draft = None if draft_probs is None else draft_probs[n_accepted].double()
        p = _residual(p, draft, int(draft_tokens[n_accepted]))
    return n_accepted, choices.draw(p)


def _chain_kernels(target_probs: torch.Tensor, draft_probs: torch.Tensor | None):
    """The CPU kernels' operators when ``speculative_sample`` can run as one call (float32 CPU rows), else None."""
    rows = (target_probs,) if draft_probs is None else (target_probs, draft_probs)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in rows):
        return None
    from ..kernels import ops

    return ops()


def greedy_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy rule: accept while each draft token equals the target's argmax; then emit the argmax.

    ``target_logits`` (or probabilities) is ``[k+1, V]``; returns ``(n_accepted, next_token)``.
    """
    return coupled_verify(greedy_tokens(target_logits), draft_tokens)


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


def tree_greedy_verify(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor
) -> tuple[list[int], int]:
    """Greedy rule on a tree: follow the child equal to the target's argmax at each row; then emit the argmax.

    ``target_logits`` (or probabilities) ``[n+1, V]``; returns ``(accepted_nodes, next_token)``.
    """
    return tree_coupled_verify(greedy_tokens(target_logits), draft_tokens, parents)


def tree_coupled_verify(
    target_tokens: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor
) -> tuple[list[int], int]:
    """Seed-coupled rule on a tree: from the root, move to the (first) child whose token equals the target's
    token at the current row; stop where none does and emit the target's token there.

    ``target_tokens`` ``[n+1]``: per row, the token plain decoding would emit after that row's branch (argmax,
    or Gumbel-max keyed by the row's own position). Each accepted node is plain decoding's token, so the
    output is plain decoding's; returns ``(accepted_nodes, next_token)``, the nodes a root path.
    """
    kids = children(parents)
    wanted = target_tokens.tolist()
    tokens = draft_tokens.tolist()
    accepted: list[int] = []
    row = 0
    while True:
        match = next((node for node in kids[row] if tokens[node] == wanted[row]), None)
        if match is None:
            return accepted, wanted[row]
        accepted.append(match)
        row = match + 1


def tree_speculative_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    generator: torch.Generator | Choices,
) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings; every emitted token follows the target (module docstring).

    ``target_probs`` ``[n+1, V]`` (row 0 the root, row i + 1 node i); ``draft_probs`` ``[n, V]`` with
    ``draft_probs[i]`` the distribution node i and its siblings were drawn from without replacement, or None
    for point masses. At each node, child i is accepted iff u < r(x_i) / q_i(x_i) (u a float64 uniform;
    q_i(x_i) = 0 rejects); a rejection sets r ← norm(max(0, r − q_i)) (r kept when that mass is ≤ eps) and
    q_{i+1} ← q_i with x_i removed, renormalised. Returns ``(accepted_nodes, next_token)``.
    """
    if target_probs.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"target_probs needs n+1 = {len(draft_tokens) + 1} rows, got {target_probs.shape[0]}")
    choices = as_choices(generator)
    kids = children(parents)
    tokens = draft_tokens.tolist()
    accepted: list[int] = []
    row = 0
    while True:
        residual = target_probs[row].double()
        residual = residual / residual.sum()
        draft = None if draft_probs is None or not kids[row] else draft_probs[kids[row][0]].double()
        for node in kids[row]:
            token = tokens[node]
            q_x = 1.0 if draft is None else float(draft[token])
            if choices.accept(float(residual[token]) / q_x if q_x > 0 else 0.0, token):
                accepted.append(node)
                row = node + 1
                break
            residual = _residual(residual, draft, token)
            residual = residual / residual.sum()
            if draft is not None:
                draft = draft.clone()
                draft[token] = 0.0
                mass = draft.sum()
                draft = draft / mass if mass > 0 else draft
        else:
            return accepted, choices.draw(residual)
