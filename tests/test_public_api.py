"""The public API the README and the guides promise, name by name, stays where it is (outside checks call these)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import specdecode as sd
from specdecode.cli import app
from specdecode.errors import MissingExtra, optional_import


def test_the_documented_names_are_there():
    for name in (
        "load_model", "SpeculativeDecoder", "SamplingParams", "DraftModelProposer", "PromptLookupProposer",
        "EagleProposer", "SuffixProposer", "MedusaProposer", "LayerSkipProposer", "HybridProposer",
        "autoregressive_generate", "VocabularyMismatch", "Grammar", "GenerationOutput", "LoadedModel", "Draft",
    ):  # fmt: skip
        assert hasattr(sd, name), name
    assert callable(sd.verify.speculative_sample) and callable(sd.verify.greedy_verify)
    assert callable(sd.sampling.probs_from_logits)
    assert issubclass(sd.VocabularyMismatch, ValueError)


def test_the_version_is_the_packages_and_the_cli_prints_it():
    from importlib.metadata import version

    assert sd.__version__ == version("specdecode")
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"specdecode {sd.__version__}"


def test_a_missing_optional_dependency_names_its_extra_in_one_line():
    with pytest.raises(MissingExtra, match=r"^plots needs no_such_package: pip install 'specdecode\[bench\]'$"):
        optional_import("no_such_package.pyplot", "bench", "plots")
    assert optional_import("json", "bench", "-").dumps([]) == "[]"
