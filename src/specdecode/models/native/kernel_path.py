"""The native runner's compiled-kernel path (``runner``): the whole decoder stack over the new rows of one or several
caches in one call, then the head with its top logits refined exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .kv_cache import KVCache
from .layers import Decoder
from .torch_path import embed_rows

_NO_SLOTS = torch.zeros(0, dtype=torch.int64)


def _visible_slots(start: int, k: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each of ``k`` new rows at slots ``start..`` attends to under ``mask`` [k, start + k], for the kernels:
    (prefix, extra slots, extras per row). Row i sees slots ``0..prefix[i]-1``, then its extras in ascending
    order (a tree row: its ancestors and itself)."""
    prefix = mask.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.int64)
    rest = mask & (torch.arange(mask.shape[1]) >= prefix[:, None])
    rows, slots = rest.nonzero(as_tuple=True)
    return prefix, slots, torch.bincount(rows, minlength=k)


def kernel_pass(
    decoder: Decoder,
    caches: Sequence[KVCache],
    tokens: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor | None],
    masks: Sequence[torch.Tensor | None],
    logits: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One call of the compiled decoder over every cache's new rows (``tokens[i]`` at slots ``caches[i].length..``,
    the caches reserved already), then the head: each cache's rows and entries exactly as a pass over it alone gives
    them (row invariance). Returns the last layer's rows (float32) and, if asked, the logits; the caches' lengths
    are left for the caller to advance."""
    meta: list[list[int]] = []
    offsets, extras = [0], []
    for index, (cache, chunk, pos, mask) in enumerate(zip(caches, tokens, positions, masks, strict=True)):
        start, k = cache.length, int(chunk.shape[0])
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
    x = embed_rows(decoder, torch.cat(list(tokens))).to(torch.float32).contiguous()
    decoder.lm_head.handle.kernels.decoder(
        x, decoder.kernel_layers, [c.keys for c in caches], [c.values for c in caches],
        [t for c in caches for t in c.cos], [t for c in caches for t in c.signed_sin], len(decoder.arch.ropes),
        torch.tensor(meta, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int64),
        torch.cat(extras) if extras else _NO_SLOTS, decoder.heads, decoder.kv_heads, decoder.head_dim, decoder.eps,
        decoder.scaling,
    )  # fmt: skip
    return x, _kernel_head(decoder, x) if logits else None


def _kernel_head(decoder: Decoder, x: torch.Tensor) -> torch.Tensor:
    """The final norm and LM head through the kernels: float32 logits, the top rows refined exactly."""
    kernels = decoder.lm_head.handle.kernels
    return kernels.lm_head(
        x, decoder.norm, decoder.eps, [decoder.lm_head.handle.id], decoder.vocab_size, *decoder.head_refinement
    )
