"""Plain greedy decode of 96 tokens: our runner against llama.cpp's own eval loop (a bare argmax, no Python
sampler) and against llama-cpp-python's ``generate()``, alternated, medians of 3, prefill included.

    .venv/bin/python benchmarks/plain_vs_llamacpp.py [gemma3-270m|smollm2]

Needs llama-cpp-python (not a dependency). Both read the bundled model's GGUF file with 2 threads.
"""

from __future__ import annotations

import statistics
import sys
import time

import llama_cpp
import numpy as np
import torch

import specdecode as sd
from specdecode.bench.llamacpp import gguf_file

NEW_TOKENS = 96
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main(name: str) -> None:
    torch.set_num_threads(2)
    target = sd.load_model(name)
    prompt = target.chat_prompt(PROMPT)
    llm = llama_cpp.Llama(str(gguf_file(name)), n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
    vocab = llm.n_vocab()

    def ours() -> tuple[float, list[int]]:
        runner, out = target.new_runner(), []
        start = time.perf_counter()
        runner.prefill(torch.tensor(prompt[:-1]))
        token = prompt[-1]
        for _ in range(NEW_TOKENS):
            token = int(runner.forward(torch.tensor([token]))[0].argmax())
            out.append(token)
        return time.perf_counter() - start, out

    def eval_loop() -> tuple[float, list[int]]:
        llm.reset()
        out = []
        start = time.perf_counter()
        llm.eval(prompt)
        for _ in range(NEW_TOKENS):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            out.append(int(logits.argmax()))
            llm.eval([out[-1]])
        return time.perf_counter() - start, out

    def generate() -> tuple[float, list[int]]:
        llm.reset()
        out = []
        start = time.perf_counter()
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if len(out) >= NEW_TOKENS:
                break
        return time.perf_counter() - start, out

    runs = {"ours": ours, "llama.cpp eval loop": eval_loop, "llama.cpp generate()": generate}
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(3):
        for label, run in runs.items():
            times[label].append(run()[0])
    for label, seconds in times.items():
        rate = NEW_TOKENS / statistics.median(seconds)
        print(f"{name} {label}: {rate:.1f} tok/s (median of 3, a {len(prompt)}-token prompt's prefill included)")
    print("same text, ours and llama.cpp's eval loop:", ours()[1] == eval_loop()[1])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m")
