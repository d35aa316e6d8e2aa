"""ModelRunner over any transformers causal LM (GGUF-loaded models included), with a DynamicCache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from .base import check_retained_slots


class HFRunner:
    """Generic runner: one ``model(...)`` call per forward; rollback crops the DynamicCache.

    With ``capture_hidden`` set, ``forward`` and ``prefill`` keep ``hidden``: the last decoder layer's output
    before the final norm (float32 ``[k, hidden_size]``), read by a hook on the decoder's final norm.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self._cache = DynamicCache(config=model.config)
        self._length = 0
        self.capture_hidden = False
        self.hidden: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self._length

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens``; ``positions`` ``[k]`` and a bool ``attn_mask`` ``[k, length+k]`` for a token tree."""
        return self._run(tokens, logits_to_keep=0, positions=positions, attn_mask=attn_mask)

    def prefill(self, tokens: torch.Tensor) -> None:
        """Append ``tokens`` to the cache, computing only the last position's logits."""
        self._run(tokens, logits_to_keep=1)

    @torch.inference_mode()
    def _run(
        self,
        tokens: torch.Tensor,
        logits_to_keep: int,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k = int(tokens.shape[0])
        if positions is None:
            positions = torch.arange(self._length, self._length + k)
        kwargs = {}
        if attn_mask is not None:
            if attn_mask.shape != (k, self._length + k):
                raise ValueError(f"attn_mask must have shape ({k}, {self._length + k}), got {tuple(attn_mask.shape)}")
            kwargs["attention_mask"] = attn_mask.view(1, 1, k, self._length + k)
        hook = None
        if self.capture_hidden:
            hook = self.model.get_decoder().norm.register_forward_pre_hook(self._keep_hidden)
        try:
            out = self.model(
                input_ids=tokens.view(1, k),
                position_ids=positions.view(1, k),
                cache=self._cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        finally:
            if hook is not None:
                hook.remove()
        self._length += k
        return out.logits[0, :, : self.vocab_size].float()

    def _keep_hidden(self, _module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.hidden = args[0][0].float()

    def rollback_to(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._length} tokens")
        if length < self._length:
            self._cache.crop(length - self._length)
            self._length = length

    def retain(self, start: int, slots: Sequence[int]) -> None:
        """Keep the cache entries at ``slots`` as slots ``start, start+1, ...`` (a tree's accepted branch)."""
        index = check_retained_slots(start, slots, self._length)
        for layer in self._cache.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None:
                continue
            if layer.keys.shape[-2] != self._length:
                raise ValueError("token trees need a KV cache holding every position; this model's is windowed")
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys[..., index, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values[..., index, :]], dim=-2)
        self._length = start + len(index)

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.model.config)
        self._length = 0
