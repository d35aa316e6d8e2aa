"""benchmarks/structured_output.py's checks fail loudly: greedy identity, schema validity, a cut output; its
prompts are deterministic and its totals add up."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

GOOD = json.dumps({"name": "re.sub", "summary": "Replace matches.", "parameters": ["pattern"], "returns": "str"})


def _bench():
    from benchmarks import structured_output

    return structured_output


def _out(ids: list[int], text: str, finish_reason: str = "stop") -> SimpleNamespace:
    return SimpleNamespace(token_ids=ids, text=text, finish_reason=finish_reason)


def test_a_valid_identical_pair_passes_and_each_fault_stops_the_script():
    bench = _bench()
    assert bench._check("f", _out([1, 2], GOOD), _out([1, 2], GOOD), False) is False
    faults = [
        ("greedy identity", _out([1, 2], GOOD), _out([1, 3], GOOD)),
        ("not valid under the schema", _out([1], '{"name": "x"}'), _out([1], '{"name": "x"}')),
        ("not valid under the schema", _out([1], "{oops"), _out([1], "{oops")),
        ("cut at --max-new-tokens", _out([1], "{", "length"), _out([1], "{", "length")),
    ]
    for message, plain, spec in faults:
        with pytest.raises(SystemExit, match=message):
            bench._check("f", plain, spec, False)
    assert bench._check("f", _out([1], "{", "length"), _out([1], "{", "length"), True) is True


def test_prompts_are_deterministic_and_bounded():
    bench = _bench()
    first, again = bench.extraction_prompts(3), bench.extraction_prompts(3)
    assert first == again and len(first) == 3 and first[0][0] == "json.dumps"
    assert all("Serialize" in text for name, text in first[:1])
    with pytest.raises(SystemExit, match="--limit"):
        bench.extraction_prompts(0)


def test_totals_sum_the_rows():
    bench = _bench()
    row = {"tokens": 10, "seconds": 1.0, "drafted": 4, "accepted": 2, "rounds": 5, "forced": 1, "generated": 10}
    plain = dict(row, drafted=0, accepted=0, rounds=10, forced=0)
    totals = bench._totals([{"plain": plain, "speculative": row}, {"plain": plain, "speculative": row}])
    assert totals["speculative"]["forced"] == 2 and totals["speculative"]["acceptance"] == 0.5
    assert totals["speculative"]["tokens_per_round"] == 2.0 and totals["plain"]["tokens_per_round"] == 1.0
    assert totals["speedup"] == 1.0
    assert "| speculative | 20 |" in bench.markdown({"totals": totals})
