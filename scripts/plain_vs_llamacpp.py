"""Plain greedy decode, 96 tokens: our runner vs llama.cpp's own eval loop (no Python sampler), alternated."""
import statistics, sys, time
import numpy as np, torch
torch.set_num_threads(2)
import llama_cpp
import specdecode as sd
from specdecode.bench.llamacpp import gguf_file

name = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
target = sd.load_model(name)
path = str(gguf_file(name))
prompt = target.chat_prompt("Write a short story about a lighthouse keeper who finds a message in a bottle.")
N = 96
llm = llama_cpp.Llama(path, n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
vocab = llm.n_vocab()

def ours():
    r = target.new_runner(); out = []
    t = time.perf_counter()
    r.prefill(torch.tensor(prompt[:-1])); tok = prompt[-1]
    for _ in range(N):
        tok = int(r.forward(torch.tensor([tok]))[0].argmax()); out.append(tok)
    return time.perf_counter() - t, out

def theirs_raw():
    llm.reset(); out = []
    t = time.perf_counter()
    llm.eval(prompt)
    for _ in range(N):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        tok = int(logits.argmax()); out.append(tok)
        llm.eval([tok])
    return time.perf_counter() - t, out

def theirs_generate():
    llm.reset(); out = []
    t = time.perf_counter()
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(tok))
        if len(out) >= N: break
    return time.perf_counter() - t, out

runs = {"ours": ours, "llama.cpp eval loop": theirs_raw, "llama.cpp generate()": theirs_generate}
for f in runs.values(): f()  # warm-up
times = {k: [] for k in runs}
for rep in range(3):
    for k, f in runs.items():
        dt, out = f(); times[k].append(dt)
for k, v in times.items():
    print(f"{name} {k}: {N / statistics.median(v):.1f} tok/s (median of 3, prefill of {len(prompt)} included)")
print("same text ours vs eval loop:", ours()[1] == theirs_raw()[1])
