"""The native runner's compiled-kernel path (``runner``): the whole decoder stack over every runner's
new rows in one call, then the head with its top logits refined exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .runner import NativeLlamaRunner

_NO_SLOTS = torch.zeros(0, dtype=torch.int64)


def _visible_slots(start: int, k: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each of ``k`` new rows at slots ``start..`` attends to under ``mask`` [k, start + k], for the kernels:
    (prefix, extra slots, extras per row). Row i sees slots ``0..prefix[i]-1``, then its extras in ascending
    order (a tree row: its ancestors and itself)."""
    prefix = mask.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.int64)
    rest = mask & (torch.arange(mask.shape[1]) >= prefix[:, None])
    rows, slots = rest.nonzero(as_tuple=True)
    return prefix, slots, torch.bincount(rows, minlength=k)


class KernelPath:
    """The runner's kernel calls (a mixin of ``NativeLlamaRunner``)."""

    def _run_kernels(
        self,
        runners: Sequence[NativeLlamaRunner],
        tokens: Sequence[torch.Tensor],
        positions: Sequence[torch.Tensor | None],
        masks: Sequence[torch.Tensor | None],
        logits: bool,
    ) -> list[torch.Tensor | None]:
        """One pass of the compiled decoder over every runner's new rows (their caches reserved already), then
        the head; each runner's rows and cache exactly as its own ``forward`` gives them (row invariance)."""
        meta: list[list[int]] = []
        offsets, extras, counts = [0], [], []
        for index, (runner, chunk, pos, mask) in enumerate(zip(runners, tokens, positions, masks, strict=True)):
            start, k = runner.length, int(chunk.shape[0])
            counts.append(k)
            where = range(start, start + k) if pos is None else pos.tolist()
            if mask is None:  # a chain: row i sees slots 0..start+i
                meta.extend([index, start + i, p, start + i + 1] for i, p in enumerate(where))
                offsets.extend([offsets[-1]] * k)
                continue
            prefix, slots, per_row = _visible_slots(start, k, mask)
            meta.extend([index, start + i, p, q] for i, (p, q) in enumerate(zip(where, prefix.tolist(), strict=True)))
            extras.append(slots)
            offsets.extend((offsets[-1] + per_row.cumsum(0)).tolist())
        if not extras:  # chains only: no extras
            offsets = []
        x = self._embed_rows(torch.cat(list(tokens))).to(torch.float32).contiguous()
        self._lm_head.handle.kernels.decoder(
            x, self._kernel_layers, [r._keys for r in runners], [r._values for r in runners],
            [t for r in runners for t in r._cos], [t for r in runners for t in r._signed_sin], len(self._cos),
            torch.tensor(meta, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int64),
            torch.cat(extras) if extras else _NO_SLOTS, self._heads, self._kv_heads, self._head_dim, self._eps,
            self._scaling,
        )  # fmt: skip
        head = self._kernel_head(x) if logits else None
        out: list[torch.Tensor | None] = []
        row = 0
        for runner, k in zip(runners, counts, strict=True):
            runner._length += k
            if runner.capture_hidden:
                runner.hidden = x[row : row + k]
            out.append(None if head is None else head[row : row + k])
            row += k
        return out

    def _kernel_head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head through the kernels: float32 logits, the top rows refined exactly."""
        return self._lm_head.handle.kernels.lm_head(
            x, self._norm, self._eps, [self._lm_head.handle.id], self.vocab_size, *self._head_refinement
        )
