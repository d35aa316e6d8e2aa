"""ModelRunner over any transformers causal LM (GGUF-loaded models included), with a DynamicCache."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedConfig, cache_utils
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .runner import ModelRunner, check_retained_slots

if TYPE_CHECKING:  # transformers.modeling_utils costs ~2 s at `import specdecode`; loading a model imports it
    from transformers import PreTrainedModel


def _layer_classes(*names: str) -> tuple[type, ...]:
    """The named ``transformers.cache_utils`` layer classes that this transformers version has."""
    return tuple(getattr(cache_utils, name) for name in names if hasattr(cache_utils, name))


# Cache layers kept as transformers builds them: they hold every position and ``crop`` drops exactly the tail
# (DummyLayer: KV-sharing or attention-free layers, no state; DynamicIndexedLayer: DSA's extra indexer keys).
_EXACT_LAYERS = _layer_classes("DynamicLayer", "DummyLayer", "DynamicIndexedLayer")
# Layers ``retain`` can re-slot (keys and values are their only per-position state).
_RETAINABLE_LAYERS = _layer_classes("DynamicLayer", "DummyLayer")
# Attention kinds whose token-tree mask this runner can build (the window is applied to the tree's mask).
_TREE_KINDS = frozenset({"full_attention", "sliding_attention"})
MaskArg = torch.Tensor | dict[str, torch.Tensor]


@functools.cache
def _cache_keyword(forward_class: type) -> str:
    """The keyword a model's ``forward`` takes its KV cache by: ``cache`` (transformers 5.2x on) or, before that
    rename, ``past_key_values`` (an unknown keyword is swallowed by ``**kwargs``: the model would run without
    its cache, every token as if it were the first)."""
    names = inspect.signature(forward_class.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def cache_keyword(model: torch.nn.Module | type) -> str:
    """``_cache_keyword`` of a model (or a model class)."""
    return _cache_keyword(model if isinstance(model, type) else type(model))


def full_cache(config: PreTrainedConfig) -> DynamicCache:
    """``DynamicCache(config=config)`` with every windowed layer replaced by a full ``DynamicLayer``.

    Invariant: every attention layer holds all ``length`` positions, so ``crop`` and ``retain`` are exact.
    The model still applies its sliding window: its masks come from ``config`` (``layer_types``,
    ``sliding_window``) over absolute positions, sized by the layers' ``get_mask_sizes`` (``length + k``, offset 0).
    Raises ``ValueError`` for a layer whose state cannot be rolled back (recurrent / linear attention, custom layers).
    """
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:  # keeps only the last window - 1 positions: crop can't undo
            cache.layers[index] = DynamicLayer()
        elif type(layer) not in _EXACT_LAYERS:
            raise ValueError(
                f"the transformers runner cannot roll back this model's KV cache: layer {index} is a "
                f"{type(layer).__name__}, whose state does not drop rejected tokens exactly; speculative decoding "
                "needs a cache it can crop"
            )
    return cache


def attention_kinds(config: PreTrainedConfig) -> frozenset[str]:
    """The attention kinds the model builds masks for: ``config.layer_types`` (the keys of its mask mapping),
    else the one kind transformers infers for every layer (sliding when ``sliding_window`` is set)."""
    text = config.get_text_config(decoder=True)
    declared = getattr(text, "layer_types", None)
    if declared is not None:
        return frozenset(declared)
    if getattr(text, "sliding_window", None) is not None:
        return frozenset({"sliding_attention"})
    if getattr(text, "attention_chunk_size", None) is not None:
        return frozenset({"chunked_attention"})
    return frozenset({"full_attention"})


class TransformersRunner(ModelRunner):
    """Generic runner: one ``model(...)`` call per forward; rollback crops the DynamicCache.

    The cache keeps every position of every layer (``full_cache``), so rollback and ``retain`` are exact for
    sliding-window models too; a model whose cache can't roll back is refused here, before any decoding.
    A token tree's mask gets each sliding layer's window. ``supports_trees`` is False where trees can't be run
    (chunked or indexed attention): a tree ``attn_mask`` or ``retain`` then raises ``ValueError``.

    With ``capture_hidden`` set, ``forward`` and ``prefill`` keep ``hidden``: the last decoder layer's output
    before the final norm (float32 ``[k, hidden_size]``), read by a hook on the decoder's final norm.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self._cache = full_cache(model.config)
        self._cache_keyword = cache_keyword(model)  # read once, not on every forward
        self._kinds = attention_kinds(model.config)
        self._window = (
            model.config.get_text_config(decoder=True).sliding_window if "sliding_attention" in self._kinds else None
        )
        plain = all(type(layer) in _RETAINABLE_LAYERS for layer in self._cache.layers)
        windowed = self._window is not None or "sliding_attention" not in self._kinds
        # Trees (a tree ``attn_mask``, ``retain``): full and sliding attention over plain key/value layers only.
        self.supports_trees = plain and windowed and self._kinds <= _TREE_KINDS
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
        device = self.model.device  # the engine's tensors are on the CPU; a model on a GPU computes there
        tokens = tokens.to(device)
        positions = torch.arange(self._length, self._length + k) if positions is None else positions
        positions = positions.to(device)
        attn_mask = None if attn_mask is None else attn_mask.to(device)
        kwargs = {}
        if attn_mask is not None:
            kwargs["attention_mask"] = self._tree_mask(attn_mask, positions)
        hook = None
        if self.capture_hidden:
            hook = self.model.get_decoder().norm.register_forward_pre_hook(self._keep_hidden)
        try:
            out = self.model(
                input_ids=tokens.view(1, k),
                position_ids=positions.view(1, k),
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_keyword: self._cache},
                **kwargs,
            )
        finally:
            if hook is not None:
                hook.remove()
        self._length += k
        return out.logits[0, :, : self.vocab_size].float().cpu()

    def _tree_mask(self, attn_mask: torch.Tensor, positions: torch.Tensor) -> MaskArg:
        """The model's ``attention_mask`` for a tree: ``attn_mask`` as ``[1, 1, k, length+k]`` for full layers, and
        for sliding ones also ``key position > query position - window`` (a 4-D mask reaches every layer as is).

        One tensor when all layers share a kind; a mapping by layer type (transformers' prepared-mask form) if mixed.
        """
        k, width = int(positions.shape[0]), self._length + int(positions.shape[0])
        if attn_mask.shape != (k, width):
            raise ValueError(f"attn_mask must have shape ({k}, {width}), got {tuple(attn_mask.shape)}")
        if not self.supports_trees:
            raise ValueError(
                f"token trees are not supported on this model's attention ({', '.join(sorted(self._kinds))}): "
                "use a chain proposer"
            )
        full = attn_mask.view(1, 1, k, width)
        if self._window is None:
            return self._for_attention(full)
        keys = torch.cat([torch.arange(self._length, device=positions.device), positions])
        recent = keys[None, :] > positions[:, None] - self._window
        windowed = self._for_attention(full & recent.to(attn_mask.device).view(1, 1, k, width))
        if self._kinds == {"sliding_attention"}:
            return windowed
        return {"full_attention": self._for_attention(full), "sliding_attention": windowed}

    def _for_attention(self, mask: torch.Tensor) -> torch.Tensor:
        """A bool mask as the attention implementation reads it: eager adds the mask to the scores, so it gets
        0 / dtype-min (as transformers' ``eager_mask`` builds it); sdpa and the others take bool as is."""
        if self.model.config._attn_implementation != "eager":
            return mask
        dtype = self.model.dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)

    def _keep_hidden(self, _module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        self.hidden = args[0][0].float().cpu()

    def rollback_to(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._length} tokens")
        if length < self._length:
            self._cache.crop(length - self._length)
            self._length = length

    def retain(self, start: int, slots: Sequence[int]) -> None:
        """Keep the cache entries at ``slots`` as slots ``start, start+1, ...`` (a tree's accepted branch)."""
        index = check_retained_slots(start, slots, self._length)
        if not self.supports_trees:
            raise ValueError("retain needs plain key/value cache layers; this model's cache has other state")
        for layer in self._cache.layers:
            if not layer.is_initialized or layer.keys is None:
                continue
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys[..., index, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values[..., index, :]], dim=-2)
        self._length = start + len(index)

    def reset(self) -> None:
        self._cache = full_cache(self.model.config)
        self._length = 0
