"""``LoadedModel``: a loaded causal LM with its tokenizer, the runner it gets and how its weights are stored; and
the dtypes ``load_model`` accepts."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from .formats.weights import FloatRows
from .memory import INITIAL_SLOTS, loaded_footprint
from .memory import describe as describe_memory
from .native.architecture import architecture_of, unsupported_reason
from .native.layers import KERNEL_CACHE_DTYPE
from .native.layers import uses_kernels as native_uses_kernels
from .native.runner import NativeRunner
from .runner import ModelRunner
from .transformers_runner import TransformersRunner

if TYPE_CHECKING:  # transformers.modeling_utils costs ~2 s at `import specdecode`; loading a model imports it
    from transformers import PreTrainedModel

_FAMILY_NAMES = {"llama": "Llama", "qwen3": "Qwen 3", "gemma3": "Gemma 3"}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer (optional: without one, prompts are token-id lists) and runner factory."""

    model: PreTrainedModel
    tokenizer: Any | None
    name: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    backend: str = "transformers"
    quantization: str | None = None  # how the weights are stored: None (dense), "gguf", "gguf-a8", "int8", "int4"
    formats: dict[str, int] = field(default_factory=dict)  # matrices per stored format (quantized models)
    max_context: int | None = None  # tokens a sequence may hold (prompt and output): caps each runner's KV cache
    checkpoint_dtype: torch.dtype | None = None  # an HF folder's stored weights' dtype (None: not loaded from one)

    @property
    def context_window(self) -> int | None:
        """The most tokens a sequence may hold: ``max_context`` if set, else the model's context window (None if
        its config gives none)."""
        window = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if self.max_context is None or window is None:
            return window if self.max_context is None else self.max_context
        return min(window, self.max_context)

    def describe(self) -> str:
        """One line: the runner this model got (and why not the native one), its weights, its KV cache and, on the
        native runner, its memory (weights repacked and mapped, KV cache per token, scratch per row)."""
        if self.backend == "native":
            family = architecture_of(self.model).family
            engine = "compiled kernels" if native_uses_kernels(self.model) else "PyTorch ops"
            runner = f"native runner ({_FAMILY_NAMES[family]} family, {engine})"
        else:
            runner = f"transformers runner (not native: {unsupported_reason(self.model) or 'asked for'})"
        stored = _dtype_name(self.checkpoint_dtype) if self.checkpoint_dtype is not None else None
        if self.formats:
            weights = ", ".join(f"{count} {name}" for name, count in sorted(self.formats.items(), key=lambda i: -i[1]))
            weights += f" (rounded from the checkpoint's {stored})" if stored else ""
            table = getattr(self.model.model.embed_tokens, "table", None)
            weights += f", embedding {_dtype_name(table.weight.dtype)}" if isinstance(table, FloatRows) else ""
        else:
            dense = _dtype_name(next(self.model.parameters()).dtype)
            weights = f"dense {dense}"
            if stored == dense:
                weights += " (the checkpoint's dtype)"
            elif stored:
                weights += f" (the checkpoint holds {stored})"
        kv = str(self.kv_dtype).removeprefix("torch.")
        line = f"{self.name}: {runner}; weights {weights}; KV cache {kv}"
        return line + (f"; memory: {describe_memory(loaded_footprint(self))}" if self.backend == "native" else "")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype a runner keeps its KV cache in: float16 on the compiled kernels, else the residual stream's
        (the model's dtype; float32 for quantized weights)."""
        if self.backend == "native" and native_uses_kernels(self.model):
            return KERNEL_CACHE_DTYPE
        quantized = self.quantization is not None
        return torch.float32 if quantized else next(self.model.parameters()).dtype

    @cached_property
    def vocabulary_fingerprint(self) -> str:
        """A sha256 of the id -> token table (its size alone without a tokenizer), computed once: token ids stored
        for one model (a suffix history) are only meaningful for models with the same fingerprint."""
        if self.tokenizer is None:
            table: object = {"vocab_size": self.vocab_size}
        else:
            table = self.tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        return hashlib.sha256(json.dumps(table).encode()).hexdigest()

    def new_runner(self) -> ModelRunner:
        """A fresh runner with its own empty KV cache over this model's weights (native or transformers); a native
        one's cache grows on demand up to ``context_window`` slots."""
        if self.backend == "native":
            cap = self.context_window
            first = INITIAL_SLOTS if cap is None else min(INITIAL_SLOTS, cap)
            return NativeRunner(self.model, self.vocab_size, max_length=first, max_capacity=cap)
        return TransformersRunner(self.model, self.vocab_size)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt: a string is tokenized as the tokenizer does; a list is checked and kept."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model '{self.name}' has no tokenizer: pass the prompt as a list of token ids")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens skipped); without a tokenizer, the ids space-separated."""
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer brings a chat template (else ``chat_ids`` joins the messages as plain text)."""
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` (``{"role", "content", ...}`` dicts) in the model's chat template, ``tools``
        rendered by it and, with ``generation_prompt``, the assistant's header appended: the one way a chat becomes
        a prompt (the CLI, the server, the benchmarks, training). Without a template: the messages' contents
        joined by newlines, as plain text (no tools). A template that refuses the messages raises ValueError."""
        if self.tokenizer is None:
            raise ValueError(f"model '{self.name}' has no tokenizer: pass the prompt as a list of token ids")
        if not self.has_chat_template:
            if tools:
                raise ValueError(f"model '{self.name}' has no chat template to render tools with")
            return self.encode("\n".join(str(m["content"]) for m in messages))
        from jinja2 import TemplateError  # what a template's raise_exception raises (transformers renders with jinja2)

        try:
            ids = self.tokenizer.apply_chat_template(
                list(messages), tools=tools, add_generation_prompt=generation_prompt, tokenize=True
            )
        except (TemplateError, TypeError, KeyError, IndexError) as exc:  # raise_exception, or fields it cannot read
            raise ValueError(f"the chat template refused these messages: {exc}") from None
        return [int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])]

    def chat_prompt(self, text: str) -> list[int]:
        """Token ids of ``text`` as one user turn in the model's chat template (``chat_ids``)."""
        return self.chat_ids([{"role": "user", "content": text}])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` / ``"bfloat16"`` / ``"bf16"`` … → a torch dtype (float32 and bfloat16 only)."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16):
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
