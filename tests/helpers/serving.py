"""Talking to a test server: the routes, request bodies, server-sent events and the texts they carry, the plain
texts a request must equal, and ``serve`` (a tiny model behind a real uvicorn server on a free loopback port)."""

from __future__ import annotations

import json

import specdecode as sd
from specdecode.serving import ServerConfig, create_app
from specdecode.serving.local import LocalServer

REPEATING = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"


def plain_text(target, ids, max_tokens, temperature=0.0, seed=None) -> str:
    params = sd.SamplingParams(temperature=temperature, max_new_tokens=max_tokens, seed=seed)
    return sd.autoregressive_generate(target, ids, params).text


def chat_ids(target, text: str) -> list[int]:
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def body_for(route: str, text: str, **extra) -> dict:
    if route == "chat":
        return {"messages": [{"role": "user", "content": text}], **extra}
    return {"prompt": text, **extra}


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def events(response_text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in response_text.splitlines() if line.startswith("data: ")]


def streamed_text(data: list[str]) -> str:
    text = ""
    for item in data[:-1]:
        for choice in json.loads(item)["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def serve(target, **settings) -> LocalServer:
    """A real server over ``target`` (speculating always, gamma 4, model id "tiny"; ``settings`` override them), to
    use as a context manager."""
    config = ServerConfig(
        **({"target": target, "gamma": 4, "policy": "always", "served_model_name": "tiny"} | settings)
    )
    return LocalServer(create_app(config))
