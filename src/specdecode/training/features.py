"""The frozen target's features per training sequence (last layer, before the final norm), computed once and
cached on disk in bfloat16 shards; the packed batches a training step reads from them."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..models.loaded import LoadedModel

EXTRACT_BATCH_TOKENS = 1 << 15  # padded tokens a feature forward takes off the CPU (one sequence a forward on it)


class FeatureCache:
    """The target's features per sequence (bfloat16), computed on first use and kept in shards on disk.

    Shards are memory-mapped and read a sequence at a time, so the memory a run holds is bounded by the features
    computed since the last flush (a checkpoint), not by the data: the operating system pages the rest. The disk
    is bounded by ``max_bytes`` (None: unbounded; plus one shard's header): once the shards would pass it, further
    features are computed each time they are needed and not kept. Either way a feature is its bfloat16 rounding,
    so a capped run trains exactly as an uncapped one. ``batch_tokens`` > 0 computes a batch's missing features
    in right-padded forwards of at most that many tokens (causal attention: a row never sees the padding after
    it), what keeps a GPU busy; 0 computes one sequence a forward (the CPU's default: no padding computed).
    """

    def __init__(
        self,
        folder: Path,
        target: LoadedModel,
        dtype: torch.dtype,
        max_bytes: int | None = None,
        batch_tokens: int = 0,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"the feature cache's size must be >= 0 bytes, got {max_bytes}")
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._target = target
        self._dtype = dtype
        self._max_bytes = max_bytes
        self._batch_tokens = batch_tokens
        self._extractor: torch.nn.Module | None = None
        self._shards: list[Any] = []  # open safetensors files (memory-mapped)
        self._where: dict[str, Any] = {}  # key -> the shard holding it (a later shard wins)
        self._pending: dict[str, torch.Tensor] = {}
        self.stored_bytes = 0  # the shards' sizes plus the features waiting for the next flush
        self.uncached: set[str] = set()  # keys computed but not kept: the cap was reached
        for shard in sorted(self.folder.glob("shard-*.safetensors")):
            self._open(shard)

    def _open(self, shard: Path) -> None:
        self.stored_bytes += shard.stat().st_size
        handle = safe_open(str(shard), framework="pt")
        self._shards.append(handle)
        self._where.update(dict.fromkeys(handle.keys(), handle))

    def get_many(self, keys: list[str], id_lists: list[list[int]]) -> list[torch.Tensor]:
        """``get`` for each (key, ids), the missing features computed ``batch_tokens`` at a time."""
        computed: dict[str, torch.Tensor] = {}
        if self._batch_tokens > 0:
            missing = [j for j, key in enumerate(keys) if self._stored(key, len(id_lists[j])) is None]
            group: list[int] = []
            for j in [*missing, None]:
                longest = max([len(id_lists[i]) for i in group] + [0 if j is None else len(id_lists[j])])
                if group and (j is None or (len(group) + 1) * longest > self._batch_tokens):
                    rows = self._extract_padded([id_lists[i] for i in group])
                    computed.update((keys[i], row) for i, row in zip(group, rows, strict=True))
                    group = []
                if j is not None:
                    group.append(j)
        return [self.get(key, ids, computed.get(key)) for key, ids in zip(keys, id_lists, strict=True)]

    def get(self, key: str, ids: list[int], computed: torch.Tensor | None = None) -> torch.Tensor:
        """Features [len(ids), H] in float32 (from their bfloat16 copy, so cached and fresh runs agree);
        ``computed``: the sequence's features computed elsewhere, used when none are stored."""
        found = self._stored(key, len(ids))
        if found is None:
            found = (self._extract(ids) if computed is None else computed).to(torch.bfloat16).contiguous()
            size = found.numel() * found.element_size()
            if self._max_bytes is None or self.stored_bytes + size <= self._max_bytes:
                self._pending[key] = found
                self.stored_bytes += size
            else:
                self.uncached.add(key)
        return found.float()

    def _stored(self, key: str, length: int) -> torch.Tensor | None:
        found = self._pending.get(key)
        if found is None and key in self._where:
            found = self._where[key].get_tensor(key)
        return found if found is not None and found.shape[0] == length else None

    def flush(self) -> None:
        """Write the features computed since the last flush as a new shard."""
        if not self._pending:
            return
        index = len(list(self.folder.glob("shard-*.safetensors")))
        final = self.folder / f"shard-{index:05d}.safetensors"
        staging = final.with_suffix(".tmp")
        save_file(self._pending, str(staging))
        os.replace(staging, final)
        self.stored_bytes -= sum(t.numel() * t.element_size() for t in self._pending.values())
        self._pending = {}
        self._open(final)  # counts the shard as written (its header included)

    @torch.inference_mode()
    def _extract(self, ids: list[int]) -> torch.Tensor:
        """Features [len(ids), H] on the CPU, computed wherever the target's weights are."""
        model = self._model()
        device = next(model.parameters()).device
        captured: list[torch.Tensor] = []
        hook = model.get_decoder().norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            model.get_decoder()(input_ids=torch.tensor([ids], device=device), use_cache=False)
        finally:
            hook.remove()
        return captured[0][0].float().cpu()

    @torch.inference_mode()
    def _extract_padded(self, id_lists: list[list[int]]) -> list[torch.Tensor]:
        """``_extract`` of each sequence, all in one forward: right-padded with id 0, each row's real positions
        cut out of the result (a causal model's row t reads positions ≤ t only)."""
        model = self._model()
        device = next(model.parameters()).device
        width = max(len(ids) for ids in id_lists)
        padded = torch.zeros((len(id_lists), width), dtype=torch.int64)
        for row, ids in enumerate(id_lists):
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        captured: list[torch.Tensor] = []
        hook = model.get_decoder().norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            model.get_decoder()(input_ids=padded.to(device), use_cache=False)
        finally:
            hook.remove()
        features = captured[0].float().cpu()
        return [features[row, : len(ids)] for row, ids in enumerate(id_lists)]

    def _model(self) -> torch.nn.Module:
        if self._extractor is None:
            model = self._target.model
            dtype = next(model.parameters()).dtype
            self._extractor = model if dtype == self._dtype else copy.deepcopy(model).to(self._dtype)
        return self._extractor


def batch_tensors(
    cache: FeatureCache, prefix: str, sequences: list[list[int]], indices: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed (features [T, H], tokens [T], positions [T]) of the sequences ``indices``."""
    features = torch.cat(cache.get_many([f"{prefix}{i}" for i in indices], [sequences[i] for i in indices]))
    tokens = torch.tensor([t for i in indices for t in sequences[i]], dtype=torch.int64)
    positions = torch.cat([torch.arange(len(sequences[i])) for i in indices])
    return features, tokens, positions


def feature_scale(cache: FeatureCache, sequences: list[list[int]]) -> float:
    """Root mean square of the target's features over ``sequences`` (their first position excluded: it often
    carries a few outsized activations)."""
    squares = [cache.get(f"h{i}", ids)[1:].square().mean() for i, ids in enumerate(sequences)]
    return float(torch.stack(squares).mean().sqrt())


def extract_batch_tokens(device: torch.device) -> int:
    """``FeatureCache``'s batch for features computed on ``device``: one sequence a forward on the CPU."""
    return 0 if device.type == "cpu" else EXTRACT_BATCH_TOKENS
