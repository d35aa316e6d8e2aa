"""Time k-token forwards of the native runner over a warm KV cache, and split a step into where it goes.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/profile_runner.py [--target smollm2|gemma3-270m|FILE.gguf]
        [--quantization auto|gguf|int8|int4|none]
        [--dtype float32|bfloat16] [--context 500] [--ks 1,2,4,8,16,32] [--split] [--transformers]
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/profile_runner.py --contexts 128,512,2048,4096 [--rows 1,4]
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/profile_runner.py --prefill 512,1024,2048,4096 [--prefill-reps 3]
        [--split]

Loads a bundled model (SmolLM2 by default) through ``specdecode.load_model``. The table shows medians in ms per
forward and v(k) = t(k) / t(1). ``--split`` profiles forwards of ``--split-ks`` rows and divides their time into
matrices (the weight kernels), attention, small ops and Python (on the compiled kernels, from their own phase timers; on
the torch path, from torch.profiler), next to the bandwidth bound: the bytes a step must read (weights + the KV
cache) over a measured read bandwidth.
``--transformers`` also times the dense model's own forward with a DynamicCache (alternating, same tokens).
``--contexts`` instead times forwards of ``--rows`` rows over caches of each length with the kernels' phase split
(how a decode step and a verify pass grow with the context): five warm-up forwards per cache, medians of 30.
``--prefill`` instead times a prompt's prefill at each length (random token ids, seed 0, a fresh runner per prefill,
medians of ``--prefill-reps`` after one 256-token warm-up prefill); with ``--split``, the kernels' own phase timers
summed over each length's timed prefills, divided by the repetitions. Prints one JSON object: seconds per length
(and the split). To compare two commits, run it from each checkout with ``PYTHONPATH=<checkout>/src``, alternating,
never two at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

import specdecode as sd

MATRIX_OPS = ("_weight_int4pack_mm", "_weight_int8pack_mm", "aten::mv", "aten::mm", "aten::addmm", "aten::linear")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention")


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    times = []
    for rep in range(reps + warmup):
        start = time.perf_counter()
        fn()
        if rep >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def weight_bytes(loaded: sd.LoadedModel) -> int:
    """Bytes a step reads from the weights: every distinct storage of the runner's formats (embedding rows aside)."""
    runner = loaded.new_runner()
    seen: dict[int, int] = {}

    def visit(obj) -> None:
        for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
            if isinstance(value, torch.Tensor):
                seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
            elif isinstance(value, tuple):
                for item in value:
                    visit(item)
            elif hasattr(value, "__dataclass_fields__"):
                visit(value)

    for layer in runner.decoder.layers:
        visit(layer)
    visit(runner.decoder.lm_head)
    return sum(seen.values())


KERNEL_PHASES = ("RMSNorm", "matrices", "RoPE and cache writes", "attention", "SiLU·mul", "LM head", "head refine")


def split_kernels(runner, tokens: torch.Tensor, context: int, reps: int = 20) -> dict[str, float]:
    """The compiled decoder's own phase timers over ``reps`` forwards (matrices include activation quantization)."""
    kernels = runner.decoder.lm_head.handle.kernels
    for _ in range(3):
        runner.forward(tokens)
        runner.rollback_to(context)
    kernels.profile(True)
    start = time.perf_counter()
    for _ in range(reps):
        runner.forward(tokens)
        runner.rollback_to(context)
    wall = (time.perf_counter() - start) / reps * 1e3
    seconds = kernels.profile(False)
    parts = {name: s * 1e3 / reps for name, s in zip(KERNEL_PHASES, seconds, strict=False)}
    parts["Python and dispatch"] = max(0.0, wall - sum(parts.values()))
    parts["step"] = wall
    return parts


def read_bandwidth() -> float:
    """GB/s of summing a 256 MiB float32 tensor (reads only), median of 5."""
    a = torch.ones(64 * 2**20)
    return a.nbytes / median_ms(lambda: a.sum(), 5, 1) / 1e6


def split(runner, tokens: torch.Tensor, context: int, reps: int = 20) -> dict[str, float]:
    if runner.uses_kernels:
        return split_kernels(runner, tokens, context, reps)
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.forward(tokens)
        runner.rollback_to(context)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(reps):
            runner.forward(tokens)
            runner.rollback_to(context)
        wall = (time.perf_counter() - start) / reps * 1e3
    parts = {"matrices": 0.0, "attention": 0.0, "other aten ops": 0.0}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / reps
        if any(name in event.key for name in MATRIX_OPS):
            parts["matrices"] += ms
        elif any(name in event.key for name in ATTENTION_OPS):
            parts["attention"] += ms
        elif event.key.startswith("aten::"):
            parts["other aten ops"] += ms
    parts["Python and dispatch"] = max(0.0, wall - sum(parts.values()))
    parts["step (profiled)"] = wall
    return parts


def context_sweep(loaded: sd.LoadedModel, contexts: list[int], rows_list: list[int]) -> None:
    """Medians of 30 forwards of each row count over a cache of each length, with the kernels' phase split."""
    generator = torch.Generator().manual_seed(0)
    for context in contexts:
        runner = loaded.new_runner()
        runner.prefill(torch.randint(0, loaded.vocab_size, (context,), generator=generator))
        kernels = runner.decoder.lm_head.handle.kernels
        for _ in range(5):
            runner.forward(torch.tensor([42]))
            runner.rollback_to(context)
        for rows in rows_list:
            tokens = torch.randint(0, loaded.vocab_size, (rows,), generator=generator)
            kernels.profile(True)
            times = []
            for _ in range(30):
                start = time.perf_counter()
                runner.forward(tokens)
                times.append(time.perf_counter() - start)
                runner.rollback_to(context)
            seconds = kernels.profile(False)
            split = " ".join(f"{n}={s / 30 * 1e3:.2f}" for n, s in zip(KERNEL_PHASES, seconds, strict=False) if s > 0)
            print(f"cache {context}, {rows} rows: {statistics.median(times) * 1e3:.2f} ms ({split})", flush=True)


def prefill_sweep(loaded: sd.LoadedModel, target: str, lengths: list[int], reps: int, phases: bool) -> dict:
    """Median seconds of ``reps`` prefills at each length (a fresh runner each), and with ``phases`` the kernels'
    phase timers per prefill; one warm-up prefill of 256 tokens first."""
    runner = loaded.new_runner()
    if phases and not getattr(runner, "uses_kernels", False):
        raise SystemExit("profile_runner.py: --prefill --split needs the native runner on the compiled kernels")
    generator = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(0, loaded.vocab_size, (256,), generator=generator))  # warm-up
    result: dict[str, object] = {"target": target, "module": sd.__file__, "seconds": {}, "split": {}}
    for length in lengths:
        tokens = torch.randint(0, loaded.vocab_size, (length,), generator=generator)
        kernels = runner.decoder.lm_head.handle.kernels if phases else None
        if kernels is not None:
            kernels.profile(True)
        times = []
        for _ in range(reps):
            runner = loaded.new_runner()
            start = time.perf_counter()
            runner.prefill(tokens)
            times.append(time.perf_counter() - start)
        if kernels is not None:
            seconds = kernels.profile(False)
            result["split"][length] = {
                name: round(s / reps, 4) for name, s in zip(KERNEL_PHASES, seconds, strict=False)
            }
        result["seconds"][length] = round(statistics.median(times), 4)
        print(f"{length} tokens: {statistics.median(times):.3f} s", flush=True)
    return result


def k_table(loaded: sd.LoadedModel, args: argparse.Namespace) -> None:
    """Medians of k-token forwards over a warm ``--context``-token cache (and transformers' own, with
    ``--transformers``), then with ``--split`` where a step's time goes."""
    vocab = loaded.vocab_size
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (args.context,), generator=generator)
    runner = loaded.new_runner()
    runner.prefill(context)

    hf = cache = None
    if args.transformers:
        hf = sd.load_model(args.target, dtype=args.dtype, quantization=None).model
        cache = DynamicCache(config=hf.config)
        with torch.inference_mode():
            hf(context[None], cache=cache, use_cache=True)

    quantization = None if args.quantization == "none" else args.quantization
    setting = f"{args.quantization}, {args.dtype}" if quantization is None else args.quantization
    print(f"{setting}, {args.threads} threads, {args.context}-token cache, median of {args.reps} (ms/forward)")
    print("| k | native | v(k) |" + (" transformers | ratio |" if hf is not None else ""))
    print("|---|---|---|" + ("---|---|" if hf is not None else ""))
    base = None
    for k in (int(k) for k in args.ks.split(",")):
        tokens = torch.randint(0, vocab, (k,), generator=generator)

        def native(tokens: torch.Tensor = tokens) -> None:
            runner.forward(tokens)
            runner.rollback_to(args.context)

        ours = median_ms(native, args.reps)
        base = base or ours
        row = f"| {k} | {ours:.2f} | {ours / base:.2f} |"
        if hf is not None:

            @torch.inference_mode()
            def theirs(tokens: torch.Tensor = tokens) -> None:
                hf(tokens[None], cache=cache, use_cache=True)
                cache.crop(-tokens.numel())

            other = median_ms(theirs, args.reps)
            row += f" {other:.2f} | {other / ours:.2f}x |"
        print(row)
    if args.split:
        split_report(loaded, runner, context, args)


def split_report(loaded: sd.LoadedModel, runner, context: torch.Tensor, args: argparse.Namespace) -> None:
    """Each ``--split-ks`` forward's profiled parts, and the bytes a step reads over the measured read bandwidth."""
    decoder = runner.decoder
    kv_bytes = 2 * len(decoder.layers) * decoder.kv_heads * args.context * decoder.head_dim
    kv_bytes *= runner.cache.keys.element_size()
    weights = weight_bytes(loaded)
    read = weights + kv_bytes
    for k in (int(k) for k in args.split_ks.split(",")):
        parts = split(runner, context[:k], args.context)
        print(f"\n{k}-token forward at a {args.context}-token cache, profiled (ms):")
        for name, ms in parts.items():
            print(f"  {name:<22} {ms:6.2f}")
    bandwidth = read_bandwidth()
    print(f"  bytes read per step: {read / 1e6:.1f} MB (weights {weights / 1e6:.1f}, KV cache {kv_bytes / 1e6:.1f})")
    print(f"  read bandwidth {bandwidth:.1f} GB/s → bandwidth bound {read / bandwidth / 1e6:.2f} ms per step")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2", help="a bundled model (smollm2, gemma3-270m) or a GGUF file")
    parser.add_argument("--quantization", default="gguf", choices=["auto", "gguf", "gguf-a8", "int8", "int4", "none"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--ks", default="1,2,4,8,16,32")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--split", action="store_true", help="profile forwards (with --prefill: prefills)")
    parser.add_argument("--split-ks", default="1", help="rows per profiled forward, e.g. 1,8")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' forward (dense)")
    parser.add_argument("--contexts", help="instead: forwards over caches of these lengths, e.g. 128,512,2048,4096")
    parser.add_argument("--rows", default="1,4", help="--contexts: rows per forward")
    parser.add_argument("--prefill", help="instead: prefills of prompts of these lengths, e.g. 512,1024,2048,4096")
    parser.add_argument("--prefill-reps", type=int, default=3, help="--prefill: timed prefills per length")
    args = parser.parse_args()
    if args.contexts and args.prefill:
        parser.error("--contexts and --prefill are separate modes: give one")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    quantization = None if args.quantization == "none" else args.quantization
    loaded = sd.load_model(args.target, dtype=args.dtype, quantization=quantization)
    if args.contexts:
        context_sweep(loaded, [int(x) for x in args.contexts.split(",")], [int(x) for x in args.rows.split(",")])
    elif args.prefill:
        lengths = [int(x) for x in args.prefill.split(",")]
        print(json.dumps(prefill_sweep(loaded, args.target, lengths, args.prefill_reps, args.split)))
    else:
        k_table(loaded, args)


if __name__ == "__main__":
    main()
