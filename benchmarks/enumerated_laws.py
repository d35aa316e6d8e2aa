"""The engine's exact laws of the test suite (``enumeration.engine_law``): for each law and warp, the runs it took,
the seconds, the probability that a guess was accepted on the way, and the total variation from the target's
own law; then the minimally biased controls' TV. The numbers of docs/EXACTNESS.md's enumeration table.

    .venv/bin/python benchmarks/enumerated_laws.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.models import SMALL_VOCAB, tiny_llama  # noqa: E402
from test_enumeration import MIXED, POINT_MASS, T1, WARPED, case  # noqa: E402

import specdecode as sd  # noqa: E402
import specdecode.verify  # noqa: E402
from specdecode.enumeration import engine_law, prefix_law, total_variation  # noqa: E402


def row(label: str, decoder: sd.SpeculativeDecoder, prompt: list[int], params: sd.SamplingParams, tokens=2) -> str:
    started = time.perf_counter()
    result = engine_law(decoder, prompt, params, tokens=tokens)
    seconds = time.perf_counter() - started
    tv = total_variation(result.law, prefix_law(decoder.target, prompt, params, tokens=tokens))
    return f"| {label} | {result.runs:,} | {seconds:.2f} | {result.accepted_mass:.3f} | {tv:.1e} |"


def main() -> None:
    target = sd.load_model(tiny_llama(SMALL_VOCAB, seed=0))
    print("| law | warp | runs | seconds | P(a guess accepted) | TV from the target's law |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in POINT_MASS:
        for warp, params in WARPED.items():
            decoder, prompt = case(name, target)
            print(row(f"{name} | {warp}", decoder, prompt, params))
    correct = specdecode.verify._residual

    def mixed(target_probs, draft, token):
        residual = correct(target_probs, draft, token)
        return (1 - MIXED) * residual / residual.sum() + MIXED * target_probs / target_probs.sum()

    specdecode.verify._residual = mixed
    try:
        for name in ("chain/lookup", "tree/lookup-3-branches", "tree/deep-wide-3-2"):
            decoder, prompt = case(name, target)
            print(row(f"{name}, residual mixed {MIXED:.0%} (control) | T1", decoder, prompt, T1))
    finally:
        specdecode.verify._residual = correct


if __name__ == "__main__":
    main()
