"""Where an EAGLE chain round's time goes: the shipped head's propose() timed alone, then torch's profiler over
one greedy generation (chain of 3, 96 tokens), grouped by op and input shape.

    .venv/bin/python scripts/profile_head_step.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

import specdecode as sd


def main() -> None:
    torch.set_num_threads(2)
    target = sd.load_model("smollm2")
    proposer = sd.EagleProposer(target, tree_nodes=None)
    decoder = sd.SpeculativeDecoder(target, proposer, gamma=3)
    prompt = target.chat_prompt("Explain to a ten-year-old why the sky turns orange and red at sunset.")
    params = sd.SamplingParams(max_new_tokens=96)
    decoder.generate(prompt, params)  # warm-up
    propose, times = proposer.propose, []

    def timed(*args, **kwargs):
        started = time.perf_counter()
        draft = propose(*args, **kwargs)
        times.append(time.perf_counter() - started)
        return draft

    proposer.propose = timed
    started = time.perf_counter()
    out = decoder.generate(prompt, params)
    total = time.perf_counter() - started
    proposer.propose = propose
    median = sorted(times)[len(times) // 2]
    tokens = len(out.token_ids)
    print(f"{len(times)} rounds, propose median {median * 1e3:.2f} ms; {total * 1e3:.0f} ms for {tokens} tokens")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        decoder.generate(prompt, params)
    table = prof.key_averages(group_by_input_shape=True)
    widths = {"max_name_column_width": 30, "max_shapes_column_width": 60}
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, **widths))


if __name__ == "__main__":
    main()
