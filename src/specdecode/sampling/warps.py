"""The warps that read a row's context — ``logit_bias``, then the repetition, frequency and presence penalties —
applied to the target's logits of every verified row, before temperature, min-p, top-k and top-p (``sampling``).

A verify pass's row 0 predicts the token after the request's context c; row r ≥ 1 predicts the token after c plus
the draft tokens on the path to node r − 1 (a chain: c + d[:r]). Each row is warped with the counts of that
context, accepted-if-verified draft tokens included, so its distribution is the one plain decoding uses after the
same tokens: the acceptance rule, the residual and the keyed noise then see the target's warped law at every row,
and exactness and reproducible mode hold unchanged (docs/EXACTNESS.md). Plain decoding calls the same function
with no draft.

Counts per row, vectorised: the shared context's counts (one ``bincount``) plus the draft prefix's
(``paths [n, m] @ one_hot(draft) [m, V]``), exact small integers in float32, so a plain step and the matching
speculative row compute bitwise the same warped logits (greedy identity).

Definitions (vLLM's and HF's), for a row with logits ℓ:
  c_x    = occurrences of x among the generated tokens (prompt excluded; the row's draft prefix included)
  seen_x = x occurs in the prompt or among the generated tokens
  ℓ_x += bias_x;   ℓ_x ← ℓ_x / r if seen_x and ℓ_x > 0, ℓ_x · r if seen_x and ℓ_x ≤ 0;   ℓ_x −= f·c_x + p·[c_x > 0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .params import SamplingParams
from .tree import attention_mask


@dataclass(frozen=True)
class RowContexts:
    """The contexts of a pass's rows: ``context`` (prompt then generated tokens; the first ``prompt_len`` are
    the prompt) and the draft scored after it (``draft_tokens`` ``[m]``; ``parents`` ``[m]`` for a token tree,
    None for a chain). Row 0 predicts after ``context``; row r ≥ 1 after ``context`` + the path to node r − 1."""

    context: Sequence[int]
    prompt_len: int
    draft_tokens: torch.Tensor
    parents: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.draft_tokens) + 1

    def paths(self) -> torch.Tensor:
        """Bool ``[m + 1, m]``: ``paths[r, j]`` iff draft node j is in row r's context (chain: j < r)."""
        m = len(self.draft_tokens)
        if self.parents is None:
            return torch.ones(m + 1, m, dtype=torch.bool).tril(diagonal=-1)
        return attention_mask(self.parents, 0)[:, 1:]

    def row_tokens(self, row: int) -> list[int]:
        """The draft tokens in row ``row``'s context after ``context``, in order."""
        return self.draft_tokens[self.paths()[row]].tolist()


def row_counts(rows: RowContexts, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the generated tokens' counts (float32 ``[n, V]``) and whether each token was seen in the prompt or
    generated (bool ``[n, V]``)."""
    context = torch.as_tensor(list(rows.context), dtype=torch.int64)
    generated = torch.bincount(context[rows.prompt_len :], minlength=vocab_size)[:vocab_size].float()
    prompt = torch.bincount(context[: rows.prompt_len], minlength=vocab_size)[:vocab_size] > 0
    counts = generated.expand(rows.rows, vocab_size)
    if len(rows.draft_tokens):
        drafted = torch.nn.functional.one_hot(rows.draft_tokens.long(), vocab_size).float()
        counts = counts + rows.paths().float() @ drafted
    return counts, prompt | (counts > 0)


def target_logits(logits: torch.Tensor, params: SamplingParams, rows: RowContexts) -> torch.Tensor:
    """The target's logits ``[n, V]`` of each row with the warps that read its context (``logit_bias`` →
    repetition → frequency → presence), float32; ``logits`` itself when the request has none. The one per-row
    transform of the target's logits before sampling: plain and speculative decoding both go through it."""
    if not params.penalised:
        return logits
    if logits.shape[0] != rows.rows:
        raise ValueError(f"{logits.shape[0]} rows of logits for {rows.rows} row contexts")
    warped = logits.float().clone()
    vocab_size = warped.shape[-1]
    if params.logit_bias:
        tokens = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        warped[:, tokens] += bias
    if params.repetition_penalty == 1.0 and not (params.frequency_penalty or params.presence_penalty):
        return warped
    counts, seen = row_counts(rows, vocab_size)
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        penalised = torch.where(warped > 0, warped / r, warped * r)
        warped = torch.where(seen, penalised, warped)
    if params.frequency_penalty:
        warped = warped - params.frequency_penalty * counts
    if params.presence_penalty:
        warped = warped - params.presence_penalty * (counts > 0).float()
    return warped
