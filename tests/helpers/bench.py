"""The bench's check shared by the head-based proposers: chains and trees, every output plain decoding's."""

from __future__ import annotations

import pytest

import specdecode as sd


def check_bench_runs_chains_and_trees(
    target: sd.LoadedModel, method: str, folder: dict[str, str], prompts: tuple, missing: str
) -> None:
    """``method`` (eagle or medusa, its trained ``folder`` as the keyword build_methods takes) benches as a chain
    and a 4-node tree at gamma 3, every output identical to plain decoding's; without a folder on a target that
    ships none, build_methods raises ``missing``."""
    from specdecode.bench.methods import build_methods
    from specdecode.bench.runner import BenchConfig, run_bench
    from specdecode.bench.workloads import WorkItem

    methods = build_methods(target, [method], [3], transformers=False, tree_nodes=[0, 4], **folder)
    assert [m.name for m in methods] == ["ours:plain", f"ours:{method}-chain:g3", f"ours:{method}-t4:g3"]
    items = [WorkItem(1, "writing", prompts)]
    result = run_bench(target, items, methods, BenchConfig(max_new_tokens=12))
    assert len(result.records) == len(prompts) * 3 and all(r.identical for r in result.records)
    with pytest.raises(ValueError, match=missing):
        build_methods(target, [method], [3], transformers=False)
