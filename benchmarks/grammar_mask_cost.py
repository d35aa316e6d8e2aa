"""Grammar mask cost per token, llguidance vs xgrammar, at the bundled models' vocabularies (issue 55).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/grammar_mask_cost.py [--models smollm2 gemma3-270m] [--reps 3]

For each bundled tokenizer (SmolLM2: 49,152 tokens; Gemma 3: 262,144) and each grammar (a JSON schema of a record,
and ``json_object``: any JSON object), the script tokenizes one valid document of a few hundred tokens and walks it
through each engine's matcher: at every position it computes the mask of allowed next tokens (a bitmask), then
consumes the document's token. Reported: the grammar's compile time (tokenizer preparation apart) and the mask time
per token (median and 95th percentile over the document, the best of ``--reps`` walks), in microseconds. Every mask
must allow the document's next token, or the walk stops with an error (a wrong measurement is worse than none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.models.loader import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "module": {"type": "string"},
        "signature": {"type": "string"},
        "arguments": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "default": {"type": ["string", "null"]}},
                "required": ["name", "default"],
                "additionalProperties": False,
            },
        },
        "returns": {"type": "string"},
        "pure": {"type": "boolean"},
        "since": {"type": "number"},
    },
    "required": ["name", "module", "signature", "arguments", "returns", "pure", "since"],
    "additionalProperties": False,
}
ARGUMENTS = [{"name": f"argument_{i}", "default": None if i % 2 else f"value {i}"} for i in range(12)]
DOCUMENT = {
    "name": "json.dumps",
    "module": "json",
    "signature": "dumps(obj, *, skipkeys=False, ensure_ascii=True, check_circular=True, allow_nan=True, indent=None)",
    "arguments": ARGUMENTS,
    "returns": "Serialize obj to a JSON formatted str using this conversion table.",
    "pure": True,
    "since": 2.6,
}
GRAMMARS = {"json_schema": SCHEMA, "json_object": {"type": "object"}}


def walk_llguidance(tokenizer, vocab: int, schema: dict, ids: list[int]) -> tuple[float, list[float]]:
    """(compile seconds, mask seconds per token) for llguidance's LLMatcher over ``ids``."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    compiled = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        times.append(time.perf_counter() - t0)
        _check_allowed(bitmask, token, "llguidance")
        if not matcher.consume_token(token):
            raise SystemExit(f"llguidance refused token {token}: {matcher.get_error()}")
    return compiled, times


def walk_xgrammar(tokenizer, vocab: int, schema: dict, ids: list[int]) -> tuple[float, list[float]]:
    """(compile seconds, mask seconds per token) for xgrammar's GrammarMatcher over ``ids``."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    t0 = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
    compiled = time.perf_counter() - t0
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        _check_allowed(bitmask, token, "xgrammar")
        if not matcher.accept_token(token):
            raise SystemExit(f"xgrammar refused token {token}")
    return compiled, times


def _check_allowed(bitmask: torch.Tensor, token: int, engine: str) -> None:
    if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1:
        raise SystemExit(f"{engine}'s mask forbids the document's token {token}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    text = json.dumps(DOCUMENT)
    print("model        vocab    grammar      engine      tokens  compile ms  mask µs p50  mask µs p95")
    for model in args.models:
        tokenizer = load_tokenizer(model)
        vocab = len(tokenizer)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for grammar, schema in GRAMMARS.items():
            for engine, walk in (("llguidance", walk_llguidance), ("xgrammar", walk_xgrammar)):
                runs = [walk(tokenizer, vocab, schema, ids) for _ in range(args.reps)]
                compiled = min(c for c, _ in runs)
                times = min((t for _, t in runs), key=sum)
                p95 = sorted(times)[int(0.95 * (len(times) - 1))]
                print(
                    f"{model:12} {vocab:7}  {grammar:12} {engine:10} {len(ids):7} {compiled * 1e3:11.1f} "
                    f"{statistics.median(times) * 1e6:12.1f} {p95 * 1e6:12.1f}"
                )


if __name__ == "__main__":
    main()
