"""llama.cpp as a bench peer: its plain and prompt-lookup decoding (llama-cpp-python) on the target's GGUF file.

llama-cpp-python is optional and never a dependency: without it these methods are skipped. Greedy only;
the same prompt token ids, budget and EOS ids as our methods; its outputs need not equal ours (other numerics).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection
from pathlib import Path

from ..models.loading.bundled import BUNDLED
from ..sampling.params import SamplingParams
from .methods import Generation, Method, MethodSpec

INSTALL_HINT = "llama-cpp-python is not installed: pip install llama-cpp-python (builds llama.cpp from source, ~7 min)"
LOOKUP_TOKENS = 10
CONTEXT_STEP = 1024


class LlamaCppMissing(ImportError):
    """llama-cpp-python cannot be imported."""


def gguf_file(target: str) -> Path:
    """The GGUF file llama.cpp runs for ``target``: a bundled model's file or a .gguf path."""
    if target in BUNDLED:
        return BUNDLED[target].gguf_path()
    path = Path(target).expanduser()
    if path.suffix != ".gguf":
        raise ValueError(f"--llamacpp needs a bundled target ({', '.join(BUNDLED)}) or a .gguf file, got {target!r}")
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    return path


def llamacpp_methods(gguf: str | Path, threads: int, eos_token_ids: Collection[int]) -> list[Method]:
    """``llamacpp:plain`` and ``llamacpp:lookup`` (LlamaPromptLookupDecoding, 10 tokens) on ``gguf``."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise LlamaCppMissing(INSTALL_HINT) from None
    version = getattr(llama_cpp, "__version__", "?")
    plain = MethodSpec(
        "llamacpp:plain",
        "llama.cpp",
        description=f"llama.cpp plain decode (llama-cpp-python {version}, {Path(gguf).name})",
        quantization="gguf",
    )
    lookup = MethodSpec(
        "llamacpp:lookup",
        "llama.cpp",
        "lookup",
        LOOKUP_TOKENS,
        f"llama.cpp prompt lookup, LlamaPromptLookupDecoding(num_pred_tokens={LOOKUP_TOKENS})",
        "gguf",
    )
    return [
        _method(plain, llama_cpp.Llama, str(gguf), threads, frozenset(eos_token_ids), None),
        _method(lookup, llama_cpp.Llama, str(gguf), threads, frozenset(eos_token_ids), LlamaPromptLookupDecoding),
    ]


def _method(spec: MethodSpec, llama, path: str, threads: int, eos: frozenset[int], draft) -> Method:
    state: dict = {}

    def model(context: int):
        """The Llama, rebuilt (untimed) with a larger n_ctx when ``context`` tokens would not fit."""
        if "llm" not in state or state["llm"].n_ctx() < context:
            if "llm" in state:
                state.pop("llm").close()
            extra = {"use_extra_bufts": False} if "use_extra_bufts" in inspect.signature(llama).parameters else {}
            state["llm"] = llama(
                path,
                n_ctx=-(-context // CONTEXT_STEP) * CONTEXT_STEP,
                n_threads=threads,
                n_threads_batch=threads,
                draft_model=None if draft is None else draft(num_pred_tokens=LOOKUP_TOKENS),
                # With a draft model llama-cpp-python keeps logits for every position but sizes that buffer
                # by this flag: without it, prompts past n_batch tokens fail to broadcast into it.
                logits_all=draft is not None,
                verbose=False,
                **extra,
            )
        return state["llm"]

    def run(prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not params.greedy:
            raise ValueError("llama.cpp methods are greedy only")
        llm = model(len(prompt_ids) + params.max_new_tokens + LOOKUP_TOKENS + 1)
        llm.reset()  # no KV reuse from an earlier prompt: a full prefill, as ours does
        tokens: list[int] = []
        t0 = time.perf_counter()
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if token in eos or len(tokens) >= params.max_new_tokens:
                break
        return Generation(tokens, time.perf_counter() - t0, None)

    return Method(spec, run)


def llamacpp_verify_forward(gguf: str | Path, threads: int, max_k: int):
    """A factory for ``verify_curve.measure_verify_curves``: llama.cpp on ``gguf`` with every row's logits computed
    (``logits_all``, as our verify pass does), its cache reset to the context after each forward."""
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppMissing(INSTALL_HINT) from None

    def make(context: list[int]):
        extra = {"use_extra_bufts": False} if "use_extra_bufts" in inspect.signature(llama_cpp.Llama).parameters else {}
        size = -(-(len(context) + max_k) // CONTEXT_STEP) * CONTEXT_STEP
        llm = llama_cpp.Llama(str(gguf), n_ctx=size, n_threads=threads, n_threads_batch=threads, logits_all=True,
                              verbose=False, **extra)  # fmt: skip
        llm.reset()
        llm.eval(context)

        def forward(new: list[int]) -> None:
            llm.n_tokens = len(context)
            llm.eval(new)

        return forward

    return make
