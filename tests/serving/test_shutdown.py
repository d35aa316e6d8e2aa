"""A served process (``specdecode serve`` in a subprocess, on a small saved model and a free port) stopped by Ctrl+C
(SIGINT) or SIGTERM with streams in flight: it stops accepting, lets the streams finish within ``--shutdown-grace``
or ends them with finish_reason length and a final chunk, and exits 0 with one line, no traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.models import randomized
from helpers.tokenizers import WORDS, word_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

MAX_TOKENS = 1000  # a stream cut at SIGTERM (grace 0): thousands of milliseconds of work left
SHORT = 200  # a stream that finishes within the grace period after Ctrl+C
STREAMS = 3


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A random Llama (4 layers, hidden 256: a few ms a token, so streams of 1,000 tokens are in flight for a
    while) with the word tokenizer, saved as an HF folder the CLI loads."""
    folder = tmp_path_factory.mktemp("model")
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)  # fmt: skip
    randomized(LlamaForCausalLM(config).eval(), seed=3, weight_std=0.05).save_pretrained(folder)
    word_tokenizer(WORDS).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(folder: Path, cache: Path, grace: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "SPECDECODE_KERNELS": "0", "SPECDECODE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", "from specdecode.cli import main; main()", "serve", "--target", str(folder),
               "--port", str(port), "--threads", "1", "--proposer", "none", "--shutdown-grace", str(grace)]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {process.communicate()[1]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("the server did not start")


def stream(url: str, max_tokens: int, started: threading.Event, out: list) -> None:
    """One streamed completion: every data line, parsed (``[DONE]`` kept as a string)."""
    body = {"prompt": "w1 w2 w3", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events: list = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
    except httpx.HTTPError as error:
        events.append(error)
    out.append(events)


def stop_with_streams_in_flight(folder: Path, cache: Path, sig: signal.Signals, grace: float, max_tokens: int):
    process, url = start_server(folder, cache, grace)
    try:
        results: list = []
        threads, flags = [], []
        for _ in range(STREAMS):
            flags.append(started := threading.Event())
            threads.append(threading.Thread(target=stream, args=(url, max_tokens, started, results)))
            threads[-1].start()
        assert all(flag.wait(60) for flag in flags), "the streams did not start"
        process.send_signal(sig)
        for thread in threads:
            thread.join(90)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    return process.returncode, stderr, results


def check_streams_ended_cleanly(results: list) -> list[int]:
    """Every stream ends with a chunk carrying a finish_reason, its usage, then [DONE]; return the token counts."""
    assert len(results) == STREAMS
    counts = []
    for events in results:
        assert events and events[-1] == "[DONE]", events[-3:]
        finals = [
            e for e in events[:-1] if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
        ]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
        counts.append(events[-2]["usage"]["completion_tokens"])
    return counts


def test_ctrl_c_lets_the_streams_in_flight_finish_and_exits_0_in_one_line(model_folder, cache):
    code, stderr, results = stop_with_streams_in_flight(model_folder, cache, signal.SIGINT, grace=60, max_tokens=SHORT)
    assert code == 0, stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    assert check_streams_ended_cleanly(results) == [SHORT] * STREAMS  # all finished within the grace
    [line] = [line for line in stderr.splitlines() if "stopped on SIGINT" in line]
    assert "and 0 were cut" in line


def test_sigterm_past_the_grace_period_cuts_the_streams_with_a_final_chunk_and_exits_0(model_folder, cache):
    code, stderr, results = stop_with_streams_in_flight(
        model_folder, cache, signal.SIGTERM, grace=0, max_tokens=MAX_TOKENS
    )
    assert code == 0, stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    counts = check_streams_ended_cleanly(results)
    assert all(count < MAX_TOKENS for count in counts)  # cut short, each with its final chunk
    [line] = [line for line in stderr.splitlines() if "stopped on SIGTERM" in line]
    assert f"0 finished and {STREAMS} were cut" in line
