"""Structured output (issue 55): the grammar mask's cost per token, and JSON extraction decoded plain vs speculative.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/structured_output.py --mask-cost [--models smollm2 gemma3-270m]
        [--reps 3]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/structured_output.py --decode [--target smollm2] [--limit 10]
        [--max-new-tokens 160] [--warmup 1]

``--mask-cost``: for each bundled tokenizer (SmolLM2: 49,152 tokens; Gemma 3: 262,144) and each grammar (a JSON
schema of a record, and ``json_object``: any JSON object), the script tokenizes one valid document of a few hundred
tokens and walks it through each engine's matcher: at every position it computes the mask of allowed next tokens (a
bitmask), then consumes the document's token. Reported: the grammar's compile time (tokenizer preparation apart) and
the mask time per token (median and 95th percentile over the document, the best of ``--reps`` walks), in
microseconds. Every mask must allow the document's next token, or the walk stops with an error (a wrong measurement
is worse than none). xgrammar is measured only where it is importable; otherwise its rows say "not installed".

``--decode``: a JSON-extraction workload. Each prompt (``--limit`` of them) holds the pydoc text of one standard-library
function and asks the target, in its chat template, for a record ``{"name", "summary", "parameters", "returns"}`` under
that JSON schema (``sd.Grammar.json_schema``), greedy. Plain decoding (``autoregressive_generate`` on a reused runner)
and speculative decoding (``PromptLookupProposer``, ``gamma="auto"``) alternate per prompt, which comes first
alternating too, after ``--warmup`` untimed prompts (each docstring cut at 1,500 characters; both caches emptied before
every timed run). Reported per method: tok/s (generated tokens over wall time, prefill included), and for speculation
the speedup, acceptance, tokens per round and the grammar's forced tokens (``DecodeStats.forced``: free, counted apart
from the proposer's drafts). Every output must be valid JSON under the schema (``jsonschema``) and the speculative
tokens must equal the plain ones (greedy identity, token for token), or the script fails loudly. Prints one JSON object,
then a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os.path
import re
import statistics
import textwrap
import time

import torch

import specdecode as sd
from specdecode.models.loading.sources import load_tokenizer

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


def mask_cost(models: list[str], reps: int) -> None:
    """Print one row per model, grammar and engine: compile ms, mask µs per token (p50, p95)."""
    text = json.dumps(DOCUMENT)
    have_xgrammar = importlib.util.find_spec("xgrammar") is not None
    print("model        vocab    grammar      engine      tokens  compile ms  mask µs p50  mask µs p95")
    for model in models:
        tokenizer = load_tokenizer(model)
        vocab = len(tokenizer)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for grammar, schema in GRAMMARS.items():
            for engine, walk in (("llguidance", walk_llguidance), ("xgrammar", walk_xgrammar)):
                if engine == "xgrammar" and not have_xgrammar:
                    print(f"{model:12} {vocab:7}  {grammar:12} {engine:10} skipped: xgrammar is not installed")
                    continue
                runs = [walk(tokenizer, vocab, schema, ids) for _ in range(reps)]
                compiled = min(c for c, _ in runs)
                times = min((t for _, t in runs), key=sum)
                p95 = sorted(times)[int(0.95 * (len(times) - 1))]
                print(
                    f"{model:12} {vocab:7}  {grammar:12} {engine:10} {len(ids):7} {compiled * 1e3:11.1f} "
                    f"{statistics.median(times) * 1e6:12.1f} {p95 * 1e6:12.1f}"
                )


RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "summary": {"type": "string", "maxLength": 200},
        "parameters": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
        "returns": {"type": "string", "maxLength": 120},
    },
    "required": ["name", "summary", "parameters", "returns"],
    "additionalProperties": False,
}
FUNCTIONS = (
    json.dumps, os.path.join, re.sub, textwrap.wrap, statistics.median,
    inspect.getdoc, re.split, os.path.splitext, json.loads, textwrap.dedent,
    statistics.quantiles, re.findall,
)  # fmt: skip
INSTRUCTION = (
    "Read this Python documentation and extract a JSON record with the function's name, a one-sentence summary, "
    "the names of its parameters, and what it returns.\n\n"
)


def extraction_prompts(limit: int) -> list[tuple[str, str]]:
    """(function name, user message) for the first ``limit`` functions: deterministic, from the local docstrings."""
    if not 1 <= limit <= len(FUNCTIONS):
        raise SystemExit(f"--limit must be between 1 and {len(FUNCTIONS)}, got {limit}")
    prompts = []
    for function in FUNCTIONS[:limit]:
        name = f"{function.__module__}.{function.__qualname__}"
        try:
            signature = str(inspect.signature(function))
        except (TypeError, ValueError):
            signature = "(...)"
        doc = inspect.getdoc(function) or ""
        prompts.append((name, f"{INSTRUCTION}{name}{signature}\n\n{doc[:1500]}"))
    return prompts


def _row(out: sd.GenerationOutput, seconds: float) -> dict:
    s = out.stats
    return {"tokens": len(out.token_ids), "seconds": round(seconds, 4), "drafted": s.drafted, "accepted": s.accepted,
            "rounds": s.rounds, "forced": s.forced, "generated": s.generated}  # fmt: skip


def _check(name: str, plain: sd.GenerationOutput, spec: sd.GenerationOutput, allow_truncated: bool) -> bool:
    """Greedy identity, then schema validity; returns whether the output was cut by the token budget."""
    import jsonschema

    if spec.token_ids != plain.token_ids:
        raise SystemExit(f"greedy identity broken on {name}: plain {plain.text!r} != speculative {spec.text!r}")
    if plain.finish_reason == "length":
        if not allow_truncated:
            raise SystemExit(f"{name}: output cut at --max-new-tokens before the JSON closed; raise the budget")
        return True
    try:
        jsonschema.validate(json.loads(plain.text), RECORD_SCHEMA)
    except (ValueError, jsonschema.ValidationError) as error:
        raise SystemExit(f"{name}: output is not valid under the schema: {error}; text {plain.text!r}") from None
    return False


def decode(target_name: str, limit: int, max_new_tokens: int, warmup: int, allow_truncated: bool) -> dict:
    """Plain vs prompt-lookup speculation on the extraction prompts, alternated; totals and per-prompt rows."""
    target = sd.load_model(target_name)
    params = sd.SamplingParams(grammar=sd.Grammar.json_schema(RECORD_SCHEMA), max_new_tokens=max_new_tokens)
    runner = target.new_runner()
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma="auto")
    methods = {
        "plain": lambda ids: sd.autoregressive_generate(target, ids, params, runner=runner),
        "speculative": lambda ids: decoder.generate(ids, params),
    }
    prompts = extraction_prompts(limit)
    for _, text in prompts[:warmup]:
        for run in methods.values():
            run(target.chat_prompt(text))
    rows, truncated = [], 0
    for i, (name, text) in enumerate(prompts):
        ids = target.chat_prompt(text)
        order = list(methods) if i % 2 == 0 else list(reversed(methods))
        outs, row = {}, {"function": name, "prompt_tokens": len(ids)}
        for method in order:
            decoder.forget_cache()
            start = time.perf_counter()
            outs[method] = methods[method](ids)
            row[method] = _row(outs[method], time.perf_counter() - start)
        truncated += _check(name, outs["plain"], outs["speculative"], allow_truncated)
        row["text"] = outs["plain"].text
        rows.append(row)
    return {"target": target_name, "prompts": len(rows), "truncated": truncated, "identical": True,
            "totals": _totals(rows), "rows": rows}  # fmt: skip


def _totals(rows: list[dict]) -> dict:
    """Per method: tokens, seconds, tok/s; for speculation also acceptance, tokens per round, forced tokens."""
    totals = {}
    for method in ("plain", "speculative"):
        summed = {key: sum(row[method][key] for row in rows) for key in rows[0][method]}
        summed["tok_per_s"] = summed["tokens"] / summed["seconds"]
        summed["acceptance"] = summed["accepted"] / summed["drafted"] if summed["drafted"] else 0.0
        summed["tokens_per_round"] = summed["generated"] / summed["rounds"] if summed["rounds"] else 0.0
        totals[method] = {key: round(value, 4) for key, value in summed.items()}
    totals["speedup"] = round(totals["speculative"]["tok_per_s"] / totals["plain"]["tok_per_s"], 4)
    return totals


def markdown(result: dict) -> str:
    """A short table of the decode totals."""
    t = result["totals"]
    lines = ["| method | tokens | tok/s | speedup | acceptance | tokens/round | drafted | forced |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for method in ("plain", "speculative"):
        m = t[method]
        speedup = t["speedup"] if method == "speculative" else 1.0
        lines.append(
            f"| {method} | {m['tokens']} | {m['tok_per_s']:.1f} | {speedup:.2f}× | {m['acceptance']:.2f} "
            f"| {m['tokens_per_round']:.2f} | {m['drafted']} | {m['forced']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--mask-cost", action="store_true", help="grammar mask time per token, per vocabulary")
    mode.add_argument("--decode", action="store_true", help="JSON extraction, plain vs speculative")
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"], help="--mask-cost tokenizers")
    parser.add_argument("--reps", type=int, default=3, help="--mask-cost walks per grammar (the best is kept)")
    parser.add_argument("--target", default="smollm2", help="--decode target model")
    parser.add_argument("--limit", type=int, default=10, help=f"--decode prompts (1..{len(FUNCTIONS)})")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1, help="--decode untimed prompts run first, both methods")
    parser.add_argument("--allow-truncated", action="store_true", help="--decode: count outputs cut by the budget "
                        "instead of failing (smoke runs only; they are not schema-checked)")  # fmt: skip
    args = parser.parse_args()
    if args.mask_cost:
        if args.reps < 1:
            raise SystemExit("--reps must be at least 1")
        mask_cost(args.models, args.reps)
        return
    if args.max_new_tokens < 1 or args.warmup < 0:
        raise SystemExit("--max-new-tokens must be at least 1 and --warmup at least 0")
    result = decode(args.target, args.limit, args.max_new_tokens, args.warmup, args.allow_truncated)
    print(json.dumps(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
