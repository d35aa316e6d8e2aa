"""ModelRunner over any transformers causal LM (GGUF-loaded models included), with a DynamicCache."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class HFRunner:
    """Generic runner: one ``model(...)`` call per forward; rollback crops the DynamicCache."""

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self._cache = DynamicCache(config=model.config)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, logits_to_keep=0)

    def prefill(self, tokens: torch.Tensor) -> None:
        """Append ``tokens`` to the cache, computing only the last position's logits."""
        self._run(tokens, logits_to_keep=1)

    @torch.inference_mode()
    def _run(self, tokens: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        k = int(tokens.shape[0])
        positions = torch.arange(self._length, self._length + k)
        out = self.model(
            input_ids=tokens.view(1, k),
            position_ids=positions.view(1, k),
            cache=self._cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self._length += k
        return out.logits[0, :, : self.vocab_size].float()

    def rollback_to(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._length} tokens")
        if length < self._length:
            self._cache.crop(length - self._length)
            self._length = length

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.model.config)
        self._length = 0
