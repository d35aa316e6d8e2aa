"""The native runner for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) and its relatives Qwen 3 and
Gemma 3 (``architecture``: query/key norms, sandwich norms, GeGLU, sliding-window layers): a ``Decoder`` over the
model's fused weights (``layers``, shared by every runner over the model) and a static KV cache of its own
(``kv_cache``).

It reads the weights of an already-loaded transformers model once (q/k/v and gate/up fused), in whatever
format they are stored (dense, or the quantized formats of ``models.formats``), then runs the same maths as
transformers' sdpa path with far less Python per token. Two paths, each a pass
over the new rows of one runner or of several runners over the same weights (``forward_batch``):

- the compiled kernels (``kernel_path``), when every matrix is a ``KernelLinear``: the whole decoder stack in one
  call, the KV cache in float16 with keys in tiles of 16 slots, attention in fixed key chunks;
- plain PyTorch otherwise (``torch_path``: dense weights, or quantized ones where the kernels did not build).

Row invariance (what makes greedy speculative output identical to plain decoding): a k-token ``forward``
gives every row bitwise the logits of a one-token step over the same keys. Every weight format is
row-invariant; on the torch path attention is made so by one call per row over exactly that row's keys, on
the kernels by a reduction that depends only on the row's own keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..runner import KVRows, ModelRunner, check_batch
from .architecture import unsupported_reason
from .kernel_path import kernel_pass
from .kv_cache import KVCache
from .layers import decoder_of
from .torch_path import torch_pass


class NativeRunner(ModelRunner):
    """``ModelRunner`` for a Llama-family transformers model: static KV cache, rollback is a length reset.

    ``num_layers=N`` runs only the first N decoder layers, then the final norm and LM head (a
    self-speculation draft that shares the model's weights but keeps its own cache). The cache starts with
    ``max_length`` slots and doubles on demand, never past ``max_capacity`` slots by doubling (a pass that
    needs more, a token tree at the cap, gets exactly its slots).
    """

    # ``prefill`` stores what one-token steps store, so a kept prefix continues bitwise as a fresh prefill would
    exact_prefix_reuse = True

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
        total = model.config.num_hidden_layers
        num_layers = total if num_layers is None else num_layers
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be in 1..{total}, got {num_layers}")
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        rows = model.lm_head.out_features
        if not 1 <= vocab_size <= rows:
            raise ValueError(f"vocab_size must be in 1..{rows}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.decoder = decoder_of(model, vocab_size, num_layers)
        d = self.decoder
        self.cache = KVCache(len(d.layers), d.kv_heads, d.head_dim, d.dtype, d.device, d.arch.ropes, d.uses_kernels,
                             max_length, max_capacity)  # fmt: skip
        self.capture_hidden = False
        self.hidden: torch.Tensor | None = None

    @property
    def uses_kernels(self) -> bool:
        """True when forwards run the compiled kernels (``specdecode.kernels``), False on the pure-torch path."""
        return self.decoder.uses_kernels

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
        return self.cache.length

    def prefill(self, tokens: torch.Tensor) -> None:
        """Append ``tokens`` to the cache without computing their logits.

        Every row's keys/values are bitwise those ``forward`` (and so one-token steps) would store: attention runs
        one call per row on the torch path too, so a cache built by any mix of prefills and steps over the same
        tokens is the same cache (what a reused prefix relies on: ``append_rows``, the prefix cache)."""
        self._pass([self], [tokens], [None], [None], logits=False)

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
        end = self.length + tokens.shape[0]
        if attn_mask is not None and attn_mask.shape != (tokens.shape[0], end):
            raise ValueError(f"attn_mask must have shape ({tokens.shape[0]}, {end}), got {tuple(attn_mask.shape)}")
        return self._pass([self], [tokens], [positions], [attn_mask], logits=True)[0]

    def forward_batch(self, runners: Sequence[ModelRunner], tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Append ``tokens[i]`` (a chain, int64 ``[k_i]``) to ``runners[i]``'s cache in ONE pass through the weights.

        The runners share this runner's weights and layers, each with its own KV cache. Every matrix sees all rows
        at once; attention runs per row over its own request's keys. Row invariance makes each runner's logits
        ``[k_i, vocab_size]`` bitwise those of its own ``forward(tokens[i])``: a request's output does not depend
        on which requests share the batch.
        """
        check_batch(runners, tokens)
        if not all(isinstance(r, NativeRunner) and r.decoder.same_weights(self.decoder) for r in runners):
            raise ValueError("forward_batch needs runners over the same model's weights and layers")
        return self._pass(runners, tokens, [None] * len(runners), [None] * len(runners), logits=True)

    def rollback_to(self, length: int) -> None:
        """Drop cache entries past ``length``: the slots are simply overwritten later."""
        self.cache.rollback_to(length)

    def retain(self, start: int, slots: Sequence[int]) -> None:
        """Keep the cache entries at ``slots`` (ascending, in ``start..length-1``), moved to ``start, start+1, ...``."""
        self.cache.retain(start, slots)

    def reset(self) -> None:
        """Empty the cache."""
        self.cache.reset()

    def export_rows(self, start: int, end: int) -> KVRows:
        """A copy of the cache entries at slots ``start..end-1`` (on the kernels, ``start`` a multiple of 16)."""
        return self.cache.export_rows(start, end)

    def append_rows(self, rows: KVRows) -> None:
        """Append entries ``export_rows`` copied from a runner over the same weights (``KVCache.append_rows``)."""
        self.cache.append_rows(rows)

    @torch.inference_mode()
    def _pass(
        self,
        runners: Sequence[NativeRunner],
        tokens: Sequence[torch.Tensor],
        positions: Sequence[torch.Tensor | None],
        masks: Sequence[torch.Tensor | None],
        logits: bool,
    ) -> list[torch.Tensor | None]:
        """One pass of this runner's decoder over every runner's new rows (each cache grown first, then advanced);
        each runner's logits (if asked) and, where it captures them, its rows' features."""
        counts = [int(chunk.shape[0]) for chunk in tokens]
        for runner, k in zip(runners, counts, strict=True):
            runner.cache.reserve(runner.length + k)
        run = kernel_pass if self.decoder.uses_kernels else torch_pass
        x, head = run(self.decoder, [r.cache for r in runners], tokens, positions, masks, logits)
        out: list[torch.Tensor | None] = []
        row = 0
        for runner, k in zip(runners, counts, strict=True):
            runner.cache.advance(k)
            if runner.capture_hidden:
                runner.hidden = x[row : row + k].float()
            out.append(None if head is None else head[row : row + k])
            row += k
        return out
