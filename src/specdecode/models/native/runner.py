"""The native runner for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) and its relatives Qwen 3 and
Gemma 3 (``architecture``: query/key norms, sandwich norms, GeGLU, sliding-window layers), with a static KV
cache.

It reads the weights of an already-loaded transformers model once (q/k/v and gate/up fused), in whatever
format they are stored (dense, or the quantized formats of ``models.formats``), then runs the same maths as
transformers' sdpa path with far less Python per token. Two paths:

- the compiled kernels (``kernels/``), when every matrix is a ``KernelLinear``: the whole decoder stack in one
  call, the KV cache in float16 with keys in tiles of 16 slots, attention in fixed key chunks;
- plain PyTorch otherwise (dense weights, or quantized ones where the kernels did not build): RMSNorm in
  float32, RoPE from precomputed cos/sin tables, grouped-query attention through
  ``scaled_dot_product_attention`` with the query heads of each key/value head packed together, SiLU MLP;
  quantized weights with a float32 residual stream and bfloat16 inputs to PyTorch's weight-only kernels.

Row invariance (what makes greedy speculative output identical to plain decoding): a k-token ``forward``
gives every row bitwise the logits of a one-token step over the same keys. Every weight format is
row-invariant; on the torch path attention is made so by one call per row over exactly that row's keys, on
the kernels by a reduction that depends only on the row's own keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.weights import Int8Groups, KernelRows
from .architecture import unsupported_reason
from .kernel_path import KernelPath
from .kv_cache import KVCacheSlots
from .layers import REFINED_LOGITS, _kernel_layers, _weights
from .torch_path import TorchPath


class NativeLlamaRunner(KVCacheSlots, TorchPath, KernelPath):
    """``ModelRunner`` for a Llama-family transformers model: static KV cache, rollback is a length reset.

    ``num_layers=N`` runs only the first N decoder layers, then the final norm and LM head (a
    self-speculation draft that shares the model's weights but keeps its own cache). The cache starts with
    ``max_length`` slots and doubles on demand, never past ``max_capacity`` slots by doubling (a pass that
    needs more, a token tree at the cap, gets exactly its slots).
    """

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        max_length: int = 4096,
        num_layers: int | None = None,
        max_capacity: int | None = None,
    ):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"the native runner does not reproduce {type(model).__name__} exactly ({reason}); "
                "use the transformers runner"
            )
        config = model.config
        total = config.num_hidden_layers
        num_layers = total if num_layers is None else num_layers
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be in 1..{total}, got {num_layers}")
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        weights = _weights(model)
        rows = model.lm_head.out_features
        if not 1 <= vocab_size <= rows:
            raise ValueError(f"vocab_size must be in 1..{rows}, got {vocab_size}")
        attn = model.model.layers[0].self_attn

        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self._dtype = weights.dtype
        self._arch = weights.arch
        self._embed_scale = None if weights.arch.embed_scale is None else weights.arch.embed_scale.to(weights.dtype)
        self._device = weights.norm.device
        self._embed = weights.embed
        self._layers = weights.layers[:num_layers]
        self._norm = weights.norm
        self._lm_head = weights.lm_head
        self._exact_head_rows = exact = weights.exact_head_rows
        # The kernels' head refines its top logits from an int8 table, or from its own tiles (KernelRows), or not.
        q, scale = (exact.q, exact.scale) if isinstance(exact, Int8Groups) else (None, None)
        from_head = isinstance(exact, KernelRows) and exact.matrix is weights.lm_head
        self._head_refinement = (q, scale, REFINED_LOGITS if q is not None or from_head else 0, from_head)
        self._eps = config.rms_norm_eps
        self._hidden_shape = (config.hidden_size,)
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._groups = self._heads // self._kv_heads
        self._head_dim = attn.head_dim
        self._scaling = attn.scaling
        self._intermediate = config.intermediate_size
        self._kernel_layers = _kernel_layers(self._layers, self._lm_head, config, self._head_dim)
        self._length = 0
        self._capacity = 0
        self._max_capacity = max_capacity
        self._allocate(max_length)
        self.capture_hidden = False
        self.hidden: torch.Tensor | None = None

    @property
    def uses_kernels(self) -> bool:
        """True when forwards run the compiled kernels (``specdecode.kernels``), False on the pure-torch path."""
        return self._kernel_layers is not None

    def _rope_rows(
        self, start: int, end: int, positions: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per RoPE table, the (cos, signed sin) rows of slots ``start..end-1`` or of ``positions``."""
        where = slice(start, end) if positions is None else positions
        return [(cos[where], sin[where]) for cos, sin in zip(self._cos, self._signed_sin, strict=True)]

    def prefill(self, tokens: torch.Tensor) -> None:
        """Append ``tokens`` to the cache without computing their logits.

        Every row's keys/values are bitwise those ``forward`` (and so one-token steps) would store: attention runs
        one call per row on the torch path too, so a cache built by any mix of prefills and steps over the same
        tokens is the same cache (what a reused prefix relies on: ``copy_rows_from``, the prefix cache)."""
        self._run(tokens, None, None, logits=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` (int64 ``[k]``) at slots ``length..length+k-1``; return float32 logits ``[k, vocab_size]``.

        By default token i sits at position ``length+i`` and attends to slots ``<= length+i``. For a token
        tree, ``positions`` (int64 ``[k]``) overrides the RoPE positions and ``attn_mask`` (bool
        ``[k, length+k]``, True = may attend) overrides the causal mask.

        Row invariance: each row's logits are bitwise those of a one-token call that sees the same keys in the
        same order (for a chain, plain decoding). Every matrix format is row-invariant; attention runs one
        call per row over exactly that row's keys, because a k-row attention reduces in another order.
        """
        return self._run(tokens, positions, attn_mask, logits=True)

    @torch.inference_mode()
    def _run(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, attn_mask: torch.Tensor | None, logits: bool
    ) -> torch.Tensor | None:
        k = tokens.shape[0]
        start = self._length
        end = start + k
        if attn_mask is not None and attn_mask.shape != (k, end):
            raise ValueError(f"attn_mask must have shape ({k}, {end}), got {tuple(attn_mask.shape)}")
        self._reserve(end)
        if self.uses_kernels:
            return self._run_kernels([self], [tokens], [positions], [attn_mask], logits)[0]
        tables = self._rope_rows(start, end, positions)
        visible = self._visible_keys(start, k, attn_mask) if k > 1 or attn_mask is not None else None
        kv_heads, groups, head_dim = self._kv_heads, self._groups, self._head_dim

        def attend(i: int, queries: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
            keys, values = self._store(i, start, new_keys, new_values)
            window = self._layers[i].window
            if visible is None:  # one row
                first = end - window if 0 < window < end else 0
                q = queries.view(1, kv_heads, groups, head_dim)
                return F.scaled_dot_product_attention(
                    q, keys[:, :, first:end], values[:, :, first:end], scale=self._scaling
                )
            return self._attend_rows(queries, keys, values, new_keys, new_values, start, visible, window)

        x = self._decoder_layers(self._embed_rows(tokens), tables, attend)
        self._length = end
        if self.capture_hidden:
            self.hidden = x.float()
        return self._head(x) if logits else None


@torch.inference_mode()
def forward_batch(runners: Sequence[NativeLlamaRunner], tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Append ``tokens[i]`` (a chain, int64 ``[k_i]``) to ``runners[i]``'s cache in ONE pass through the weights.

    The runners share one model's weights, each with its own KV cache. Every matrix sees all rows at once;
    attention runs per row over its own request's keys. Row invariance makes each runner's logits
    ``[k_i, vocab_size]`` bitwise those of its own ``forward(tokens[i])``: a request's output does not depend
    on which requests share the batch.
    """
    lead = runners[0]
    for runner in runners[1:]:
        same_layers = len(runner._layers) == len(lead._layers) and all(
            a is b for a, b in zip(runner._layers, lead._layers, strict=True)
        )
        if not same_layers or runner._norm.data_ptr() != lead._norm.data_ptr():
            raise ValueError("forward_batch needs runners over the same model's weights and layers")
    starts = [runner.length for runner in runners]
    counts = [int(t.shape[0]) for t in tokens]
    for runner, start, k in zip(runners, starts, counts, strict=True):
        runner._reserve(start + k)
    if lead.uses_kernels:
        return lead._run_kernels(runners, tokens, [None] * len(runners), [None] * len(runners), logits=True)
    per_runner = [r._rope_rows(s, s + k, None) for r, s, k in zip(runners, starts, counts, strict=True)]
    tables = [
        (torch.cat([rows[t][0] for rows in per_runner]), torch.cat([rows[t][1] for rows in per_runner]))
        for t in range(len(lead._cos))
    ]
    offsets = [sum(counts[:i]) for i in range(len(counts))]

    def attend(i: int, queries: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
        rows = []
        for runner, start, k, offset in zip(runners, starts, counts, offsets, strict=True):
            mine_keys, mine_values = new_keys[offset : offset + k], new_values[offset : offset + k]
            keys, values = runner._store(i, start, mine_keys, mine_values)
            chain = [start + j + 1 for j in range(k)]
            mine = queries[offset : offset + k]
            window = lead._layers[i].window
            rows.append(runner._attend_rows(mine, keys, values, mine_keys, mine_values, start, chain, window))
        return torch.cat(rows)

    x = lead._decoder_layers(lead._embed_rows(torch.cat(list(tokens))), tables, attend)
    logits = lead._head(x)
    out = []
    for runner, start, k, offset in zip(runners, starts, counts, offsets, strict=True):
        runner._length = start + k
        if runner.capture_hidden:
            runner.hidden = x[offset : offset + k].float()
        out.append(logits[offset : offset + k])
    return out
