"""docs/EXACTNESS.md's table of production paths × promises is benchmarks/exactness_table.py's output: every test it
names exists, and its bounds are the tests' own constants (regenerate with ``--write``)."""

from __future__ import annotations

from benchmarks import exactness_table as script


def test_the_docs_table_is_the_scripts_output():
    assert script.table() in script.DOC.read_text(), "run: python benchmarks/exactness_table.py --write"


def test_the_docs_power_table_is_the_scripts_output():
    """The stated power of the engine-level tests: their sizes and thresholds read from the test modules, the laws
    computed, the pooled cells' worst case (exactness.check.pooled_shape) included."""
    assert script.power_table() in script.DOC.read_text(), "run: python benchmarks/exactness_table.py --write"
