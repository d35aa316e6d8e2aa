"""A cheaper LM head for a model that only drafts: the head's own rows for the first ``keep`` token ids, plus the rows
of the tokens a request has seen that lie past them (and the special tokens); every other logit is −inf.

A draft's numerics never change the output: the tokens it proposes are checked against the target, and when it
samples, the verifier is handed the distribution it actually sampled from (zero outside the kept tokens), so the
acceptance rule ``min(1, p/q)`` and the residual ``norm(max(0, p − q))`` keep the output the target's exactly. What the
cut buys is bytes: a one-token draft step reads every weight once, and a vocabulary of 151,936 rows is ~30% of a
0.5B model's. Byte-level BPE and SentencePiece vocabularies number their tokens roughly by frequency (merge order,
score), so the first ids are the common ones; the rest of a request's own tokens (an identifier in the code being
edited) come back as extras.

The kept logits are the head's own first ``keep`` rows, computed by the compiled head over its first tiles only (the
tiles are stored in row order): no copy, and bitwise the full head's logits before its exact refinement of the top
few (a draft skips it). The extras are computed in float32 from their exact rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..formats.kernel_linear import KernelLinear
from .layers import Decoder

MAX_EXTRAS = 4096  # a request's tokens past ``keep`` a head computes (their float32 rows: 14 MiB at hidden 896)


class DraftingHead:
    """Logits over the first ``keep`` token ids, the ``always`` ids and the current context's own tokens past
    ``keep`` (``use``), −inf elsewhere (``logits``). The kept set is a function of the context alone, so the law a
    draft samples from depends on nothing a previous request left behind."""

    def __init__(self, decoder: Decoder, keep: int, always: Iterable[int] = ()) -> None:
        if not self.supports(decoder):
            raise ValueError("a drafting head needs the compiled kernels and a quantized head with exact rows")
        if not 0 < keep < decoder.vocab_size:
            raise ValueError(f"keep must be in 1..{decoder.vocab_size - 1}, got {keep}")
        self._decoder = decoder
        self.keep = keep
        self.vocab_size = decoder.vocab_size
        self._always = {int(t) for t in always if keep <= int(t) < decoder.vocab_size}
        self._rows: dict[int, torch.Tensor] = {}  # exact float32 rows fetched so far (bounded: see ``use``)
        self._extra_ids = torch.zeros(0, dtype=torch.int64)
        self._extra_rows = torch.zeros(0, decoder.hidden_shape[0])
        self.use(())

    @staticmethod
    def supports(decoder: Decoder) -> bool:
        """Whether ``decoder``'s head can be cut: a compiled head, with exact rows for the extras."""
        return (
            decoder.uses_kernels and isinstance(decoder.lm_head, KernelLinear) and decoder.exact_head_rows is not None
        )

    @property
    def extras(self) -> int:
        return int(self._extra_ids.numel())

    def use(self, context: Iterable[int]) -> None:
        """Compute logits for ``context``'s tokens past ``keep`` (the first ``MAX_EXTRAS`` of them by id) and the
        ``always`` ids, and no others past ``keep``, until the next ``use``."""
        wanted = sorted(self._always.union(t for t in map(int, context) if self.keep <= t < self.vocab_size))
        wanted = wanted[:MAX_EXTRAS]
        if wanted == self._extra_ids.tolist():
            return
        missing = [t for t in wanted if t not in self._rows]
        if missing:
            if len(self._rows) + len(missing) > 2 * MAX_EXTRAS:
                self._rows.clear()  # a bound on the memo, not on one context
                missing = wanted
            fetched = self._decoder.exact_head_rows(torch.tensor(missing, dtype=torch.int64))
            self._rows.update(zip(missing, fetched, strict=True))
        self._extra_ids = torch.tensor(wanted, dtype=torch.int64)
        width = self._extra_rows.shape[1]
        self._extra_rows = torch.stack([self._rows[t] for t in wanted]) if wanted else torch.zeros(0, width)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [k, hidden] (the last decoder layer's rows, before the final norm) → float32 logits [k, V]."""
        d = self._decoder
        handle = d.lm_head.handle
        kept = handle.kernels.lm_head(hidden, d.norm, d.eps, [handle.id], self.keep, None, None, 0, False)
        out = kept.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        out[:, : self.keep] = kept
        if self.extras:
            x = hidden.float()
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + d.eps) * d.norm.float()
            out[:, self._extra_ids] = normed @ self._extra_rows.T
        return out
