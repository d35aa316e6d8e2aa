"""docs/EXACTNESS.md's table of production paths × promises is benchmarks/exactness_table.py's output: every test it
names exists, and its bounds are the tests' own constants (regenerate with ``--write``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "exactness_table.py"


def test_the_docs_table_is_the_scripts_output():
    spec = importlib.util.spec_from_file_location("exactness_table", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.table() in script.DOC.read_text(), "run: python benchmarks/exactness_table.py --write"
