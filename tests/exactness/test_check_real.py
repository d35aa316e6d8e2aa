"""check-exact at real size: the Qwen2.5-Coder 1.5B target with its 0.5B sibling drafting (Q4_K_M GGUF files,
V = 151,936; T 0.7, top-p 0.9, γ 2), the first one and two tokens sampled ``SAMPLES`` times through the code a user
runs (the compiled chain rule and draws) and tested against the target's exact law at family false-alarm rate
``ALPHA``; each report states the TV it detects with probability 0.9. Control: the same check on the index-shifting
mutant build (``kernels.MUTANTS``, compiled in) must fail. Slow; skips where the pair is absent (CI never has it:
``specdecode.bench.real_pair``).
"""

from __future__ import annotations

import time

import pytest
from helpers.kernels import use_build

import specdecode as sd
from specdecode.bench.real_pair import find_real_pair
from specdecode.exactness.check import check_exactness

pytestmark = pytest.mark.slow

PARAMS = sd.SamplingParams(temperature=0.7, top_p=0.9)
SAMPLES, GAMMA, ALPHA = 400, 2, 0.01
PROMPT = "import"  # raw text, no chat template: many likely next tokens (a chat turn's first token is nearly certain)


@pytest.fixture(scope="module")
def pair() -> tuple[sd.LoadedModel, sd.LoadedModel]:
    found = find_real_pair()
    if isinstance(found, str):
        pytest.skip(found)
    return sd.load_model(str(found.target)), sd.load_model(str(found.draft))


@pytest.mark.parametrize("variant", ["native", "mutant_index"])
def test_check_exact_on_the_real_pair(pair, variant, monkeypatch):
    """Proves the promise where users run it: the real pair's first two tokens follow the target's law (both
    tests pass, guesses accepted and rejected); the mutant build fails the same check."""
    use_build(variant, monkeypatch)
    target, draft = pair
    started = time.perf_counter()
    report = check_exactness(
        target, sd.DraftModelProposer(draft), [target.encode(PROMPT)], PARAMS, SAMPLES, GAMMA, alpha=ALPHA
    )
    seconds = time.perf_counter() - started
    print(f"\n{variant}: {report.verdict} ({seconds:.0f} s, {report.accepted}/{report.drafted} accepted)")
    for test in report.tests:
        print(f"  K={test.k}: χ² {test.statistic:.1f}, df {test.dof}, p {test.p_value:.3g}, "
              f"detects TV ≥ {test.detectable_tv:.3f}")  # fmt: skip
    if variant == "native":
        assert report.passed, report.verdict
        assert all(test.dof >= 3 and test.detectable_tv < 0.5 for test in report.tests), "a vacuous check"
        assert 0 < report.accepted < report.drafted, (report.accepted, report.drafted)
    else:
        assert not report.passed, report.verdict
