"""Self-drafts that skip any layers: the view, skip sets on disk, the replay behind tune-skip, and the command."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.enumeration import LAW_BOUND, enumerated_tv
from helpers.fixtures import skip_target as skip_target
from helpers.models import tiny_llama, weakened, word_target
from helpers.tokenizers import WORDS
from typer.testing import CliRunner

import specdecode as sd
import specdecode.cli as cli
from specdecode import factory
from specdecode.bench import skip_search
from specdecode.proposers.layer_skip import SkipSet, parse_layer_list, self_draft_model, skipping_model
from specdecode.sampling.params import SamplingParams

runner = CliRunner()


def _without(model: torch.nn.Module, skip: set[int]) -> torch.nn.Module:
    """A deep copy of ``model`` with the layers in ``skip`` really removed (the reference)."""
    ref = copy.deepcopy(model)
    kept = [i for i in range(len(ref.model.layers)) if i not in skip]
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in kept])
    for j, layer in enumerate(ref.model.layers):
        layer.self_attn.layer_idx = j
    ref.config.num_hidden_layers = len(kept)
    if getattr(ref.config, "layer_types", None):
        ref.config.layer_types = [ref.config.layer_types[i] for i in kept]
    return ref


def _incremental(view: sd.LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """The view's logits for ``ids`` fed in three pieces through its own runner (cache and rollback used)."""
    run = view.new_runner()
    return torch.cat([run.forward(ids[:5]), run.forward(ids[5:6]), run.forward(ids[6:])])


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_a_skipping_view_computes_the_model_without_those_layers_and_shares_its_weights(backend):
    model = tiny_llama(64, seed=3, num_layers=5)
    target = sd.load_model(model, backend=backend)
    view = skipping_model(target, [1, 3])
    ids = torch.randint(0, 64, (14,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = _without(model, {1, 3})(ids[None]).logits[0]
    torch.testing.assert_close(_incremental(view, ids), expected, atol=1e-4, rtol=0)
    assert view.model.model.layers[1].self_attn.q_proj is model.model.layers[2].self_attn.q_proj  # shared
    assert len(target.model.model.layers) == 5 and target.model.config.num_hidden_layers == 5  # untouched
    assert [layer.self_attn.layer_idx for layer in target.model.model.layers] == [0, 1, 2, 3, 4]


def test_a_gemma_skip_keeps_each_layers_window_and_rope():
    from helpers.native import gemma3

    model = gemma3()  # layers: sliding, full, sliding, sliding
    target = sd.load_model(model)
    assert target.backend == "native"
    ids = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _without(model, {0, 2})(ids[None]).logits[0]
    torch.testing.assert_close(_incremental(skipping_model(target, [0, 2]), ids), expected, atol=1e-4, rtol=0)


def test_greedy_speculation_with_a_skip_set_is_identical_to_plain():
    target = sd.load_model(tiny_llama(64, seed=5, num_layers=4))
    params = SamplingParams(max_new_tokens=40)
    prompt = [3, 9, 4, 3, 9, 4, 17]
    plain = sd.autoregressive_generate(target, prompt, params).token_ids
    for skip in ([1], [0, 2], [3]):
        decoder = sd.SpeculativeDecoder(target, sd.LayerSkipProposer(target, skip=skip), gamma=3)
        out = decoder.generate(prompt, params)
        assert out.token_ids == plain
        assert out.stats.drafted > 0


def test_the_replay_counts_the_rounds_the_engine_takes():
    """tune-skip's prediction rests on this: replaying the teacher-forced agreements gives the engine's rounds."""
    target = sd.load_model(weakened(tiny_llama(64, seed=11, num_layers=4), {1, 2}, 0.3))
    prompt = [5, 1, 7, 5, 1, 7, 2]
    (run,) = skip_search.continuations(target, [prompt], 48)
    for skip, gamma in (((1,), 2), ((1, 2), 4), ((2,), 1), ((3,), 3)):
        accepted = skip_search.agreement(skipping_model(target, skip), [run])[0]
        decoder = sd.SpeculativeDecoder(target, sd.LayerSkipProposer(target, skip=skip), gamma=gamma)
        out = decoder.generate(prompt, SamplingParams(max_new_tokens=48))
        assert out.token_ids == run.tokens[run.prompt_length :]
        assert out.stats.rounds == skip_search.chain_rounds(accepted, gamma)
        assert out.stats.accepted == sum(min(r, gamma) for r in _runs(accepted, gamma))
        assert 0 < sum(accepted) < len(accepted)  # both outcomes happen: the check has teeth


def _runs(accepted: list[bool], gamma: int) -> list[int]:
    """The accepted run of each replayed round (independent of chain_rounds: by splitting at rejections)."""
    runs, position = [], 0
    while position < len(accepted):
        run = 0
        while run < gamma and position + run < len(accepted) and accepted[position + run]:
            run += 1
        runs.append(min(run, len(accepted) - position - 1))  # the last round's final token is not a guess
        position += run + 1
    return runs


def test_chain_rounds_by_hand():
    T, F = True, False
    assert skip_search.chain_rounds([T, T, F, T, T, T, T, F], 2) == 3  # runs 2 | 2 | 1 then the end
    assert skip_search.chain_rounds([F] * 5, 3) == 5
    assert skip_search.chain_rounds([T] * 5, 8) == 1
    assert skip_search.chain_rounds([T] * 9, 2) == 3
    with pytest.raises(ValueError):
        skip_search.chain_rounds([T], 0)


def test_the_step_cost_model_and_the_prediction():
    step = skip_search.StepCost(fixed_ms=2.0, per_layer_ms=1.0, layers=8)
    assert step.ratio(8) == 1.0 and step.ratio(3) == pytest.approx(0.5)
    # 10 tokens in 4 rounds at gamma 2, c = 0.5, v(3) = 1.5: 10 / (4 * 2.5) = 1.0
    assert skip_search.predicted_speedup(4, 10, 2, 0.5, lambda k: 1.5) == pytest.approx(1.0)
    # with prefills (in steps) of 5 for the target and 2.5 for the draft: (5 + 10) / (5 + 2.5 + 10)
    assert skip_search.predicted_speedup(4, 10, 2, 0.5, lambda k: 1.5, 5.0, 2.5) == pytest.approx(15 / 17.5)


def test_a_skip_set_round_trips_and_refuses_what_does_not_fit(tmp_path):
    target = sd.load_model(tiny_llama(64, seed=5, num_layers=4))
    path = tmp_path / "skip.json"
    SkipSet("tiny", 4, (1, 2), {"gamma": 3}).save(path)
    loaded = SkipSet.load(path)
    assert loaded == SkipSet("tiny", 4, (1, 2)) and loaded.search == {"gamma": 3} and loaded.kept == (0, 3)
    view = self_draft_model(target, f"skip:{path}")
    assert len(view.model.model.layers) == 2
    assert len(self_draft_model(target, "skip:0-2").model.model.layers) == 1
    assert parse_layer_list("3, 5,1-2", 8) == (1, 2, 3, 5)
    with pytest.raises(ValueError, match="4-layer target"):
        skipping_model(sd.load_model(tiny_llama(64, seed=5, num_layers=6)), loaded)
    with pytest.raises(ValueError, match="between 1 and 3"):
        parse_layer_list("0-3", 4)
    with pytest.raises(ValueError, match="0..3"):
        SkipSet("t", 4, (7,))
    with pytest.raises(ValueError, match="ranges like"):
        parse_layer_list("a,b", 4)
    (tmp_path / "other.json").write_text(json.dumps({"skip": [1]}))
    with pytest.raises(ValueError, match="not a skip set"):
        SkipSet.load(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError, match="tune-skip"):
        SkipSet.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="num_layers .* or skip"):
        sd.LayerSkipProposer(target)


@pytest.fixture
def four_layer_target(monkeypatch):
    loaded = word_target(seed=5, num_layers=4)
    monkeypatch.setattr(factory, "load", lambda name, *settings: loaded)
    return loaded


def test_tune_skip_writes_a_set_that_generate_uses(four_layer_target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"question_id": i, "category": "qa", "turns": [" ".join(WORDS[i : i + 6] * 2)]} for i in range(3)]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "skip.json"
    argv = ["tune-skip", "--prompts", str(prompts), "--out", str(out), "--new-tokens", "12", "--max-skip", "2"]
    result = runner.invoke(cli.app, [*argv, "--max-gamma", "3", "--confirm", "2"])
    assert result.exit_code == 0, result.output
    skip_set = SkipSet.load(out)
    search = skip_set.search
    assert skip_set.layers == 4 and 1 <= len(skip_set.skip) <= 2
    assert [len(c["skip"]) for c in search["path"]] == [1, 2] and len(search["confirmed"]) == 2
    assert all(c["differing"] == 0 for c in search["confirmed"])
    assert "greedy path" in result.stdout and f"--draft skip:{out}" in result.stdout
    plain = runner.invoke(cli.app, ["generate", "w1 w2 w3", "--raw", "--json", "--max-new-tokens", "16"])
    spec = runner.invoke(
        cli.app,
        ["generate", "w1 w2 w3", "--raw", "--json", "--max-new-tokens", "16", "--proposer", "draft",
         "--draft", f"skip:{out}"],
    )  # fmt: skip
    assert spec.exit_code == 0, spec.output
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--draft", "skip:nope.json"], "skip set not found"),
        (["--draft", "skip:0-3"], "between 1 and 3"),
        (["--draft", "skip:x"], "ranges like"),
    ],
)
def test_skip_mistakes_are_one_line_errors(four_layer_target, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(cli.app, ["generate", "w1 w2", "--proposer", "draft", *argv])
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output


def test_a_native_skip_view_runs_in_transformers_generate_once_renumbered():
    """The bench's hf:assisted peer hands the draft to transformers, whose cache is indexed by layer_idx."""
    from specdecode.proposers.layer_skip import for_transformers

    model = tiny_llama(64, seed=3, num_layers=4)
    view = skipping_model(sd.load_model(model), [1])
    assert [layer.self_attn.layer_idx for layer in view.model.model.layers] == [0, 2, 3]  # the target's own
    renumbered = for_transformers(view)
    assert [layer.self_attn.layer_idx for layer in renumbered.model.model.layers] == [0, 1, 2]
    assert [layer.self_attn.layer_idx for layer in view.model.model.layers] == [0, 2, 3]  # the view untouched
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    got = renumbered.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = _without(model, {1}).generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()
    assert for_transformers(renumbered) is renumbered


# ------------------------------------------------------------------------------------------------ exact laws


@pytest.mark.parametrize("control", [False, True], ids=["exact", "residual-mixed-1%-build-control"])
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_layer_skip_drafts_give_the_targets_law_exactly(skip_target, gamma, control, monkeypatch):
    """Proves a layer-skip self-draft (sampled q from the target's own layers, shared weights and all) keeps the
    engine's law of the first two tokens the target's to 1e-6 at γ = 1, 2, 3 (T 1, top-k 2), every decision
    enumerated through the compiled chain rule. Control: the kernels built with 1% of p mixed into the residual
    (kernels.MUTANTS) must miss by ≥ 100× the bound."""
    decoder = sd.SpeculativeDecoder(skip_target, sd.LayerSkipProposer(skip_target, skip=[1]), gamma=gamma)
    tv, result = enumerated_tv(decoder, "mutant_residual" if control else "native", monkeypatch)
    if control:
        assert tv > 100 * LAW_BOUND, tv
    else:
        assert tv < LAW_BOUND, (gamma, tv, result.runs)
        assert result.accepted_mass > 0.5 and result.runs > 2 * gamma, result
