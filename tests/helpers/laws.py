"""Law checks and the WRONG verifiers the negative controls run (each must be caught)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare


def chisquare_pvalue(counts, probs) -> float:
    """Chi-square goodness of fit of ``counts`` to ``probs`` (normalised); cells with expected count < 5 pooled.

    An outcome the law gives probability 0 fails at once.
    """
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    probs = probs / probs.sum()
    assert counts[probs == 0].sum() == 0, "an outcome the target gives probability 0 occurred"
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def resample_from_target(target_probs, draft_probs, draft_tokens, generator):
    """A WRONG verifier (the negative control): the min(1, p/q) test, but a rejection resamples from p
    instead of the residual norm(max(0, p − q))."""
    k = int(draft_tokens.shape[0])
    for i in range(k):
        p = float(target_probs[i, draft_tokens[i]])
        q = 1.0 if draft_probs is None else float(draft_probs[i, draft_tokens[i]])
        if not float(torch.rand((), dtype=torch.float64, generator=generator)) < p / q:
            return i, int(torch.multinomial(target_probs[i].double(), 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k].double(), 1, generator=generator))


def biased_tree_sample(
    target_probs, draft_probs, draft_tokens, parents, generator, *, update_residual=True, remove_tried=True
):
    """A WRONG tree rule (negative controls): recursive rejection over siblings with one step left out —
    the residual not updated after a rejected sibling, or tried siblings not removed from q."""
    from specdecode.sampling.tree import children

    kids = children(parents)
    accepted, row = [], 0
    while True:
        residual = target_probs[row].double()
        q = None if draft_probs is None or not kids[row] else draft_probs[kids[row][0]].double().clone()
        for node in kids[row]:
            x = int(draft_tokens[node])
            q_x = 1.0 if q is None else float(q[x])
            if q_x > 0 and float(torch.rand((), dtype=torch.float64, generator=generator)) < float(residual[x]) / q_x:
                accepted.append(node)
                row = node + 1
                break
            if update_residual:
                removed = torch.nn.functional.one_hot(torch.tensor(x), len(residual)) if q is None else q
                left = (residual - removed).clamp_min(0.0)
                residual = left / left.sum() if left.sum() > 1e-12 else residual
            if q is not None and remove_tried:
                q[x] = 0.0
                q = q / q.sum() if q.sum() > 0 else q
        else:
            return accepted, int(torch.multinomial(residual, 1, generator=generator))


def plain_law(target, prompt: list[int], tokens: int, step_law) -> dict[tuple[int, ...], float]:
    """Plain sampling's exact law of the first ``tokens`` tokens after ``prompt``: every prefix of nonzero mass
    enumerated, ``step_law(logits, prefix)`` giving the next token's distribution after it (the target's logits of
    one forward over prompt + prefix). The reference the enumerated engine laws are compared with."""
    runner = target.new_runner()
    law: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == tokens:
            law[prefix] = mass
            return
        runner.reset()
        logits = runner.forward(torch.tensor([*prompt, *prefix], dtype=torch.int64))[-1]
        probs = step_law(logits, prefix)
        for token in torch.nonzero(probs > 0).flatten().tolist():
            extend((*prefix, token), mass * float(probs[token]))

    extend((), 1.0)
    return law
