"""Medusa heads: training (loss falls, resume = uninterrupted), drafts (chain and tree), greedy identity through the
loop, the exact sampling law (enumerated), heads for another target refused, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.bench import check_bench_runs_chains_and_trees
from helpers.kernels import use_build
from helpers.models import LARGE_VOCAB, tiny_llama, word_target
from helpers.tokenizers import WORDS
from safetensors.torch import load_file
from typer.testing import CliRunner

import specdecode as sd
from specdecode.heads.medusa import load_heads
from specdecode.proposers.medusa import MedusaProposer, best_paths, chain
from specdecode.training.medusa import MedusaSettings, train_medusa

GREEDY = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
PROMPTS = [[3, 17, 5, 9], [1, 4], [60, 2, 2, 2, 7, 33, 12, 40, 8]]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Text the tiny target wrote itself (temperature 0.5)."""
    target, folder = word_target(), tmp_path_factory.mktemp("medusa-corpus")
    generator = torch.Generator().manual_seed(3)
    for i in range(40):
        prompt = torch.randint(0, LARGE_VOCAB, (3,), generator=generator).tolist()
        out = sd.autoregressive_generate(target, prompt, sd.SamplingParams(temperature=0.5, max_new_tokens=45, seed=i))
        (folder / f"{i:02d}.txt").write_text(" ".join(WORDS[t] for t in prompt + out.token_ids))
    return folder


def settings(corpus: Path, **overrides) -> MedusaSettings:
    base = dict(
        data=str(corpus), held_out=4, max_length=48, batch_tokens=96, epochs=4, lr=1e-2, warmup_steps=2,
        draft_vocab=56, checkpoint_every=5, extract_dtype="float32",
    )  # fmt: skip
    return MedusaSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> tuple[Path, list[float]]:
    """Heads trained briefly for ``large_target``, and the training losses."""
    losses: list[float] = []
    folder = tmp_path_factory.mktemp("medusa-heads") / "heads"
    train_medusa(word_target(), settings(corpus), folder, on_step=lambda p: losses.append(p.loss))
    return folder, losses


@pytest.fixture(scope="module")
def heads_dir(trained) -> Path:
    return trained[0]


def test_training_makes_the_loss_fall_and_saves_bfloat16_heads(trained):
    folder, losses = trained
    assert len(losses) >= 40 and sum(losses[-5:]) < 0.8 * sum(losses[:5])
    config = json.loads((folder / "config.json").read_text())
    figures = config["training"]["held_out_by_draft_vocab"]["56"]
    assert config["num_heads"] == 3 and len(figures["top1_by_head"]) == 3 and len(figures["rank_accuracy"][0]) == 10
    assert figures["top1_by_head"][0] > 3 / LARGE_VOCAB  # well above chance
    stored = load_file(str(folder / "heads.safetensors"))
    assert set(stored) == {"weight", "bias", "draft_vocab"} and stored["weight"].dtype == torch.bfloat16
    assert stored["weight"].shape == (3, 32, 32) and stored["draft_vocab"].shape == (56,)


def test_resumed_training_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, corpus):
    target = word_target()
    short = settings(corpus, epochs=2)
    whole = train_medusa(target, short, tmp_path / "whole")

    class Interrupt(Exception):
        pass

    def stop_at_7(progress):
        if progress.step == 7:  # past the checkpoint at step 5: resuming replays steps 6 and 7
            raise Interrupt

    with pytest.raises(Interrupt):
        train_medusa(target, short, tmp_path / "split", on_step=stop_at_7)
    with pytest.raises(ValueError, match="--resume"):
        train_medusa(target, short, tmp_path / "split")
    with pytest.raises(ValueError, match="lr"):
        train_medusa(target, settings(corpus, epochs=2, lr=1e-3), tmp_path / "split", resume=True)
    resumed = train_medusa(target, short, tmp_path / "split", resume=True)
    assert resumed.steps == whole.steps and resumed.by_vocab == whole.by_vocab
    a, b = (load_file(str(tmp_path / name / "heads.safetensors")) for name in ("whole", "split"))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_resume_refuses_another_kind_of_checkpoint_before_comparing_settings(tmp_path, corpus):
    (tmp_path / "eagle").mkdir()
    torch.save({"settings": {"passes": 2}}, tmp_path / "eagle" / "checkpoint.pt")  # an EAGLE head's: no "format"
    with pytest.raises(ValueError, match="not a Medusa training checkpoint"):
        train_medusa(word_target(), settings(corpus), tmp_path / "eagle", resume=True)


def test_heads_for_another_target_are_refused(heads_dir):
    deeper = word_target(num_layers=3)
    with pytest.raises(ValueError, match="train-medusa"):
        MedusaProposer(deeper, heads=heads_dir)
    renamed = word_target(words=list(reversed(WORDS)))
    with pytest.raises(ValueError, match="vocabulary"):
        load_heads(heads_dir, renamed)
    with pytest.raises(FileNotFoundError, match="no Medusa heads"):
        load_heads(heads_dir.parent, renamed)
    with pytest.raises(ValueError, match="no Medusa heads are shipped"):
        MedusaProposer(renamed)


def test_settings_and_choices_are_validated(large_target, heads_dir):
    with pytest.raises(ValueError, match="heads"):
        MedusaSettings(heads=0)
    with pytest.raises(ValueError, match="max_length"):
        MedusaSettings(max_length=4, heads=3)
    for bad, message in [([], "non-empty"), ([(0, 0)], "prefix"), ([(0,), (0,), (1,)], "distinct")]:
        with pytest.raises(ValueError, match=message):
            MedusaProposer(large_target, heads=heads_dir, choices=bad)
    with pytest.raises(ValueError, match="1 to 3 ranks"):
        MedusaProposer(large_target, heads=heads_dir, choices=chain(4))
    with pytest.raises(ValueError, match="drafting vocabulary"):
        MedusaProposer(large_target, heads=heads_dir, choices=[(56,)])
    with pytest.raises(ValueError, match="tree_nodes"):
        MedusaProposer(large_target, heads=heads_dir, tree_nodes=0)


def test_best_paths_rank_by_the_product_of_the_heads_accuracies():
    accuracy = [[0.6, 0.2, 0.08], [0.5, 0.1, 0.05], [0.4, 0.1, 0.0]]
    # (0,) 0.6, (0, 0) 0.3, (1,) 0.2, (0, 0, 0) 0.12, then (1, 0) 0.1, (2,) 0.08, (0, 1) 0.06
    assert best_paths(accuracy, 4) == [(0,), (0, 0), (1,), (0, 0, 0)]
    paths = best_paths(accuracy, 12)
    assert all(p[:-1] in paths[: paths.index(p)] for p in paths if len(p) > 1)  # prefix-closed, prefixes first


def start(target: sd.LoadedModel, context: list[int]):
    """A target runner holding ``context`` but its newest token, and the features it captured."""
    runner = target.new_runner()
    runner.capture_hidden = True
    runner.prefill(torch.tensor(context[:-1]))
    return runner, [runner.hidden]


def test_chain_and_tree_drafts_are_well_formed_and_read_the_newest_feature(large_target, heads_dir):
    """Depth d guesses head d-1's ranked choices of f_{n-2} (the newest verified feature, recomputed here from a
    fresh full pass); the feature one position earlier gives other guesses (the control)."""
    context = PROMPTS[2]
    _, features = start(large_target, context)
    tree = MedusaProposer(large_target, heads=heads_dir, choices=TREE, dtype=torch.float32, int8=False)
    tree.observe_target(features)
    runner = large_target.new_runner()
    runner.capture_hidden = True
    runner.forward(torch.tensor(context))
    newest = runner.hidden[len(context) - 2]
    with torch.no_grad():
        ranked = tree.parts.to_vocab(tree.parts.logits(tree.heads(newest[None])[0]).topk(2).indices)
        earlier = tree.parts.to_vocab(tree.parts.logits(tree.heads(runner.hidden[-3][None])[0]).topk(2).indices)
    assert not torch.equal(ranked, earlier)
    sampled = sd.SamplingParams(temperature=1.0, top_k=20)
    for k, size in ((4, 6), (2, 5), (1, 2)):
        draft = tree.propose(context, k, sampled, torch.Generator().manual_seed(0))
        assert len(draft) == size and draft.probs is None  # point masses: exact at any temperature
        paths = [p for p in TREE if len(p) <= k]
        assert draft.tokens.tolist() == [int(ranked[len(p) - 1, p[-1]]) for p in paths]
        parents = draft.parents.tolist()
        assert parents == [paths.index(p[:-1]) if len(p) > 1 else -1 for p in paths]
        for parent in set(parents):
            siblings = draft.tokens[[i for i, q in enumerate(parents) if q == parent]].tolist()
            assert len(set(siblings)) == len(siblings)
    line = MedusaProposer(large_target, heads=heads_dir, tree_nodes=None, dtype=torch.float32, int8=False)
    line.observe_target(features)
    draft = line.propose(context, 5, GREEDY, torch.Generator())
    assert draft.parents is None and draft.tokens.tolist() == ranked[:, 0].tolist()  # 3 heads: depth 3
    assert len(line.propose(context, 2, GREEDY, torch.Generator())) == 2


def test_needs_the_target_features(large_target, heads_dir):
    proposer = MedusaProposer(large_target, heads=heads_dir)
    with pytest.raises(RuntimeError, match="SpeculativeDecoder"):
        proposer.propose([1, 2, 3], 2, GREEDY, torch.Generator())
    assert len(proposer.propose([1], 2, GREEDY, torch.Generator())) == 0  # no feature yet: nothing to draft


@pytest.mark.parametrize("shape", [{"tree_nodes": None}, {"tree_nodes": 1}, {"tree_nodes": 4}, {"choices": TREE}])
def test_greedy_output_equals_plain_decoding(large_target, heads_dir, shape):
    decoder = sd.SpeculativeDecoder(large_target, MedusaProposer(large_target, heads=heads_dir, **shape), gamma=4)
    accepted = 0
    for prompt in PROMPTS:
        out = decoder.generate(prompt, GREEDY)
        assert out.token_ids == sd.autoregressive_generate(large_target, prompt, GREEDY).token_ids
        accepted += out.stats.accepted
    assert accepted > 0  # the heads learned something: guesses are accepted


def test_reproducible_sampling_equals_plain_sampling(large_target, heads_dir):
    params = sd.SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=30, seed=11)
    for prompt in PROMPTS[:2]:
        plain = sd.autoregressive_generate(large_target, prompt, params).token_ids
        for shape in ({"tree_nodes": None}, {"choices": TREE}):
            proposer = MedusaProposer(large_target, heads=heads_dir, **shape)
            decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=3, mode="reproducible")
            assert decoder.generate(prompt, params).token_ids == plain


def test_drafts_for_the_target_as_loaded_quantized(heads_dir):
    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=10), quantization="int8")
    decoder = sd.SpeculativeDecoder(target, MedusaProposer(target, heads=heads_dir, choices=TREE), gamma=3)
    for prompt in PROMPTS:
        out = decoder.generate(prompt, GREEDY)
        assert out.token_ids == sd.autoregressive_generate(target, prompt, GREEDY).token_ids


ENUMERATED = sd.SamplingParams(temperature=0.8, top_k=4, max_new_tokens=4)


@pytest.mark.parametrize(
    ("case", "shape", "gamma"),
    [
        ("chain", {"tree_nodes": None}, 2),
        ("tree", {"choices": TREE}, 3),
        ("residual-control", {"choices": TREE}, 3),
        ("chain-residual-control", {"tree_nodes": None}, 2),
    ],
)
@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_medusa_laws_enumerated_exactly(large_target, heads_dir, case, shape, gamma, path, monkeypatch):
    """The engine's exact law of the first two tokens (every decision enumerated, ``enumeration.engine_law``) with
    Medusa's point-mass chain and tree is the target's to float32 rounding (TV < 1e-5; measured ~1e-8 on the native
    runner, up to ~1e-6 on transformers'), on the torch verification path and through the compiled ops; the
    controls (the residuals mixed 1% with the target's law: the tree's, torch code on either path; the chain's,
    through the compiled ops the build whose point-mass residual keeps the guess) are off by far more (~2e-3)."""
    from specdecode.exactness.enumeration import engine_law, prefix_law, total_variation

    compiled = path == "kernels" and case == "chain-residual-control"
    if path == "kernels":
        use_build("mutant_point_mass" if compiled else "native", monkeypatch)
    if case.endswith("residual-control") and not compiled:
        correct = sd.verify._residual
        monkeypatch.setattr(
            sd.verify, "_residual", lambda p, q, x: 0.99 * (r := correct(p, q, x)) / r.sum() + 0.01 * p / p.sum()
        )
    decoder = sd.SpeculativeDecoder(large_target, MedusaProposer(large_target, heads=heads_dir, **shape), gamma=gamma)
    tvs = []
    for prompt in PROMPTS[:2]:
        result = engine_law(decoder, prompt, ENUMERATED, tokens=2, through_kernels=path == "kernels")
        tvs.append(total_variation(result.law, prefix_law(large_target, prompt, ENUMERATED, tokens=2)))
        assert result.accepted_mass > 0.05, result.accepted_mass
    if case.endswith("residual-control"):
        assert max(tvs) > 1e-4, tvs
    else:
        assert max(tvs) < 1e-5, tvs


def test_bench_runs_medusa_chains_and_trees_with_plain_output(large_target, heads_dir):
    folder = {"heads": str(heads_dir)}
    prompts = (PROMPTS[0], PROMPTS[2])
    check_bench_runs_chains_and_trees(large_target, "medusa", folder, prompts, missing="no Medusa heads are shipped")


def test_cli_trains_resumes_and_generates_with_medusa(tmp_path, monkeypatch, corpus):
    import specdecode.cli as cli
    from specdecode import factory

    target = word_target()
    monkeypatch.setattr(factory, "load", lambda name, *settings: target)
    runner = CliRunner()
    out = tmp_path / "h"
    train = ["train-medusa", "--data", str(corpus), "--out", str(out), "--held-out", "2", "--limit", "8"]
    train += ["--max-length", "40", "--batch-tokens", "80", "--checkpoint-every", "2", "--draft-vocab", "56"]
    result = runner.invoke(cli.app, train)
    assert result.exit_code == 0, result.output
    assert "held-out top-1 agreement" in result.stdout and (out / "heads.safetensors").is_file()
    again = runner.invoke(cli.app, train)
    assert again.exit_code == 1 and "--resume" in again.output
    assert runner.invoke(cli.app, [*train, "--resume"]).exit_code == 0

    common = ["generate", "w1 w2 w3 w4", "--raw", "--json", "--max-new-tokens", "16"]
    plain = json.loads(runner.invoke(cli.app, [*common, "--proposer", "none"]).stdout)["token_ids"]
    for tree in ("0", "4"):
        spec = runner.invoke(cli.app, [*common, "--proposer", "medusa", "--heads", str(out), "--tree-nodes", tree])
        assert spec.exit_code == 0, spec.output
        assert json.loads(spec.stdout)["token_ids"] == plain
    missing = runner.invoke(cli.app, [*common, "--proposer", "medusa"])
    assert missing.exit_code == 1 and "no Medusa heads are shipped" in missing.output
    misplaced = runner.invoke(cli.app, [*common, "--proposer", "lookup", "--heads", str(out)])
    assert misplaced.exit_code == 1 and "--heads applies to the medusa proposer" in misplaced.output
    check = runner.invoke(
        cli.app, ["check-exact", "--proposer", "medusa", "--heads", str(out), "--samples", "200", "--raw", "--json"]
    )
    assert check.exit_code == 0, check.output
    assert json.loads(check.stdout)["passed"]


def test_server_config_takes_medusa_heads(heads_dir, large_target):
    from specdecode.serving.config import ServerConfig
    from specdecode.serving.server import Server

    server = Server(ServerConfig(target=large_target, proposer="medusa", heads=str(heads_dir), policy="always"))
    assert isinstance(server.scheduler.decoder.proposer, MedusaProposer)
    with pytest.raises(ValueError, match="--heads"):
        ServerConfig(target=large_target, proposer="lookup", heads=str(heads_dir))


@pytest.mark.slow
def test_shipped_heads_draft_for_smollm2_with_plain_output():
    target = sd.load_model("smollm2")
    params = sd.SamplingParams(max_new_tokens=48)
    for shape in ({}, {"choices": [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]}):
        decoder = sd.SpeculativeDecoder(target, sd.MedusaProposer(target, **shape), gamma=3)
        accepted = 0
        for question in ("What is the capital of France?", "Write a haiku about autumn leaves.", "List three colours."):
            prompt = target.chat_prompt(question)
            out = decoder.generate(prompt, params)
            assert out.token_ids == sd.autoregressive_generate(target, prompt, params).token_ids
            accepted += out.stats.accepted
        assert accepted > 0  # the shipped heads' guesses are accepted (BENCHMARKS.md has their rates)
