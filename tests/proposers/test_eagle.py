"""EagleProposer: drafts through the engine with plain decoding's output (chain and tree), its cache resync."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.bench import check_bench_runs_chains_and_trees
from helpers.fixtures import head_dir as head_dir
from helpers.kernels import use_build
from helpers.models import LARGE_VOCAB, tiny_llama, word_target

import specdecode as sd
from specdecode.proposers.eagle import EagleProposer, EagleSettings

GREEDY = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
PROMPTS = [[3, 17, 5, 9], [1], [60, 2, 2, 2, 7, 33, 12, 40, 8]]


@pytest.mark.parametrize("tree_nodes", [None, 1, 4, 9])
def test_greedy_output_equals_plain_decoding(large_target, head_dir, tree_nodes):
    proposer = EagleProposer(large_target, head=head_dir, tree_nodes=tree_nodes, branching=3)
    decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=4)
    accepted = 0
    for prompt in PROMPTS:
        out = decoder.generate(prompt, GREEDY)
        assert out.token_ids == sd.autoregressive_generate(large_target, prompt, GREEDY).token_ids
        accepted += out.stats.accepted
    assert accepted > 0  # the head learned something: guesses are accepted


def test_reproducible_sampling_equals_plain_sampling(large_target, head_dir):
    params = sd.SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=30, seed=11)
    plain = sd.autoregressive_generate(large_target, PROMPTS[0], params).token_ids
    for tree_nodes in (None, 6):
        proposer = EagleProposer(large_target, head=head_dir, tree_nodes=tree_nodes)
        decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=3, mode="reproducible")
        assert decoder.generate(PROMPTS[0], params).token_ids == plain


def start(target: sd.LoadedModel, context: list[int]):
    """A target runner holding ``context`` but its newest token, and the features it captured."""
    runner = target.new_runner()
    runner.capture_hidden = True
    runner.prefill(torch.tensor(context[:-1]))
    return runner, [runner.hidden]


def test_tree_drafts_are_well_formed(large_target, head_dir):
    # float32: bfloat16 logits tie often, and top-k keeps ties
    proposer = EagleProposer(large_target, head=head_dir, tree_nodes=7, branching=3, dtype=torch.float32, int8=False)
    context = PROMPTS[2]
    _, features = start(large_target, context)
    proposer.observe_target(features)
    params = sd.SamplingParams(temperature=1.0, top_k=20)
    generator = torch.Generator().manual_seed(0)
    for k in (3, 1):
        draft = proposer.propose(context, k, params, generator)
        parents = draft.parents.tolist()
        assert 1 <= len(draft) <= 7 and all(-1 <= p < i for i, p in enumerate(parents))
        depth: list[int] = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        assert max(depth) <= k
        assert draft.probs is None  # a sampled tree offers point masses (exact for any shape)
        for parent in set(parents):
            siblings = [i for i, p in enumerate(parents) if p == parent]
            tokens = draft.tokens[siblings].tolist()
            assert len(set(tokens)) == len(tokens)  # distinct candidates


def first_path(draft: sd.Draft) -> list[int]:
    """Nodes of a root path (each node's first child), or the whole chain."""
    if draft.parents is None:
        return list(range(len(draft)))
    path = [0]
    while path[-1] in draft.parents.tolist():
        path.append(draft.parents.tolist().index(path[-1]))
    return path


@pytest.mark.parametrize("tree_nodes", [None, 5])
def test_cache_resync_after_partial_acceptance_matches_a_fresh_proposer(large_target, head_dir, tree_nodes):
    """Rounds that keep 0, 1 or 2 guesses (whatever the target says) then a target token: the long-lived
    proposer's drafts equal those of a fresh proposer that recomputes its whole cache from the features
    (in float32, where a row's result hardly depends on how many rows share the call)."""
    context = list(PROMPTS[0])
    runner, features = start(large_target, context)
    warm = EagleProposer(large_target, head=head_dir, tree_nodes=tree_nodes, dtype=torch.float32, int8=False)
    sampled = sd.SamplingParams(temperature=1.0)
    for round_ in range(9):
        warm.observe_target(features)
        draft = warm.propose(context, 4, GREEDY, torch.Generator())
        fresh = EagleProposer(large_target, head=head_dir, tree_nodes=tree_nodes, dtype=torch.float32, int8=False)
        fresh.observe_target(list(features))
        assert torch.equal(fresh.propose(context, 4, GREEDY, torch.Generator()).tokens, draft.tokens)
        a = warm.propose(context, 4, sampled, torch.Generator().manual_seed(round_))
        b = fresh.propose(context, 4, sampled, torch.Generator().manual_seed(round_))
        assert torch.equal(a.tokens, b.tokens)
        assert (a.probs is None) == (b.probs is None) and (
            a.probs is None or torch.allclose(a.probs, b.probs, atol=1e-5)
        )
        chain = draft.tokens[first_path(draft)]
        logits = runner.forward(torch.cat([torch.tensor(context[-1:]), chain]))
        n = min(round_ % 3, len(chain))
        features.append(runner.hidden[: n + 1])
        context += chain[:n].tolist() + [int(logits[n].argmax())]
        runner.rollback_to(len(context) - 1)


def test_needs_the_target_features_and_a_head(large_target, head_dir):
    proposer = EagleProposer(large_target, head=head_dir)
    with pytest.raises(RuntimeError, match="SpeculativeDecoder"):
        proposer.propose([1, 2, 3], 2, GREEDY, torch.Generator())
    assert len(proposer.propose([1], 2, GREEDY, torch.Generator())) == 0  # nothing to draft from yet
    with pytest.raises(ValueError, match="no EAGLE head is shipped"):
        EagleProposer(large_target)
    with pytest.raises(ValueError, match="tree_nodes"):
        EagleProposer(large_target, head=head_dir, tree_nodes=0)
    with pytest.raises(ValueError, match="int8=False"):
        EagleProposer(large_target, head=head_dir, dtype=torch.float32)


def test_the_keyword_knobs_and_the_settings_dataclass_build_the_same_proposer(large_target, head_dir):
    """``EagleProposer(target, head, tree_nodes=4, ...)`` (the documented keyword constructor) is
    ``EagleProposer(target, head, settings=EagleSettings(tree_nodes=4, ...))``; the settings are frozen and checked."""
    knobs = {"tree_nodes": 4, "branching": 2, "dtype": torch.float32, "int8": False}
    by_keywords = EagleProposer(large_target, head=head_dir, **knobs)
    by_settings = EagleProposer(large_target, head=head_dir, settings=EagleSettings(**knobs))
    assert by_keywords.settings == by_settings.settings == EagleSettings(**knobs)
    context = [3, 17, 5, 9]
    for proposer in (by_keywords, by_settings):
        runner = large_target.new_runner()
        runner.capture_hidden = True
        runner.prefill(torch.tensor(context[:-1]))
        proposer.observe_target([runner.hidden])
    drafts = [p.propose(context, 3, GREEDY, torch.Generator()) for p in (by_keywords, by_settings)]
    assert torch.equal(drafts[0].tokens, drafts[1].tokens) and torch.equal(drafts[0].parents, drafts[1].parents)
    with pytest.raises(dataclasses.FrozenInstanceError):
        by_settings.settings.tree_nodes = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="no setting 'tree_node'; the settings are tree_nodes, depth"):
        EagleProposer(large_target, head=head_dir, tree_node=4)
    with pytest.raises(ValueError, match="not both"):
        EagleProposer(large_target, head=head_dir, settings=EagleSettings(), tree_nodes=4)
    with pytest.raises(ValueError, match="branching"):
        EagleSettings(branching=0)


def test_int8_drafting_guesses_like_the_dense_head(large_target, head_dir):
    """The int8 matrices move the head's output by ~1% and change the read-out's choice only near ties."""
    int8 = EagleProposer(large_target, head=head_dir, tree_nodes=None)
    dense = EagleProposer(large_target, head=head_dir, tree_nodes=None, dtype=torch.float32, int8=False)
    generator = torch.Generator().manual_seed(0)
    n, size = 64, dense.head.shape.hidden_size
    features = torch.randn(n, size, generator=generator) * 30
    tokens = torch.randint(0, large_target.vocab_size, (n,), generator=generator)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    cos, sin = dense.parts.rope(torch.arange(n))
    out_dense = dense.head(features, dense.parts.embed(tokens), cos, sin, mask)[0]
    out_int8 = int8.head(features.bfloat16(), int8.parts.embed(tokens), cos.bfloat16(), sin.bfloat16(), mask)[0]
    assert (out_int8.float() - out_dense).norm() < 0.05 * out_dense.norm()
    dense_logits, int8_logits = dense.parts.logits(out_dense), int8.parts.logits(out_dense.bfloat16())
    top2 = dense_logits.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 0.05 * dense_logits.abs().amax(-1)
    assert clear.sum() > n // 2
    assert torch.equal(int8_logits.argmax(-1)[clear], dense_logits.argmax(-1)[clear])


@pytest.mark.slow
def test_shipped_head_drafts_for_smollm2_with_plain_output():
    target = sd.load_model("smollm2")
    params = sd.SamplingParams(max_new_tokens=48)
    for tree_nodes in (None, 6):
        decoder = sd.SpeculativeDecoder(target, sd.EagleProposer(target, tree_nodes=tree_nodes), gamma=4)
        accepted = 0
        for question in ("What is the capital of France?", "Write a haiku about autumn leaves."):
            prompt = target.chat_prompt(question)
            out = decoder.generate(prompt, params)
            assert out.token_ids == sd.autoregressive_generate(target, prompt, params).token_ids
            accepted += out.stats.accepted
        assert accepted > 0  # the shipped head's guesses are accepted (BENCHMARKS.md has its rates)


def test_cli_generate_with_eagle_prints_plain_decoding(head_dir, monkeypatch):
    import json

    from typer.testing import CliRunner

    import specdecode.cli as cli
    from specdecode import factory

    target = word_target()
    monkeypatch.setattr(factory, "load", lambda name, *settings: target)
    common = ["generate", "w1 w2 w3 w4", "--raw", "--json", "--max-new-tokens", "16"]
    plain = CliRunner().invoke(cli.app, [*common, "--proposer", "none"])
    for tree in ("0", "5"):
        out = CliRunner().invoke(
            cli.app, [*common, "--proposer", "eagle", "--head", str(head_dir), "--tree-nodes", tree]
        )
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    missing = CliRunner().invoke(cli.app, [*common, "--proposer", "eagle"])
    assert missing.exit_code == 1 and "no EAGLE head is shipped" in missing.output


def test_drafts_for_the_target_as_loaded_quantized(head_dir):
    """The head reads the features, embedding and LM head of the target as loaded (here int8 weights)."""
    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=10), quantization="int8")
    decoder = sd.SpeculativeDecoder(target, EagleProposer(target, head=head_dir, tree_nodes=4), gamma=4)
    for prompt in PROMPTS:
        out = decoder.generate(prompt, GREEDY)
        assert out.token_ids == sd.autoregressive_generate(target, prompt, GREEDY).token_ids


EXACT_SAMPLES, EXACT_ALPHA = 600, 1e-3  # benchmarks/exactness_table.py --power reads them


@pytest.mark.parametrize("tree_nodes", [None, 4])
def test_exact_sampling_follows_the_targets_law(large_target, head_dir, tree_nodes):
    """Chain (siblings sampled with their law) and tree (top-k point masses): the first two tokens' law is the
    target's (chi-square, family false-alarm rate 1e-3 per case, 2 cases)."""
    from specdecode.exactness.check import check_exactness

    proposer = EagleProposer(large_target, head=head_dir, tree_nodes=tree_nodes, branching=2)
    report = check_exactness(
        large_target,
        proposer,
        [PROMPTS[0]],
        sd.SamplingParams(temperature=1.0),
        samples=EXACT_SAMPLES,
        gamma=2,
        alpha=EXACT_ALPHA,
    )
    assert report.passed, report.verdict
    assert report.accepted > 0


def test_bench_runs_eagle_chains_and_trees_with_plain_output(large_target, head_dir):
    folder = {"head": str(head_dir)}
    prompts = (PROMPTS[0], PROMPTS[2])
    check_bench_runs_chains_and_trees(large_target, "eagle", folder, prompts, missing="no EAGLE head is shipped")


def _drafts_from_scratch(proposer: EagleProposer, target: sd.LoadedModel, context: list[int], depth: int, shift=0):
    """The head's greedy chain for ``context`` recomputed from nothing: the target's features of every context
    position from a fresh runner, the head over all of them in one pass, then ``depth`` guesses. ``shift``
    misaligns the features by that many positions (the negative control). Returns (tokens, logits per depth)."""
    runner = target.new_runner()
    runner.capture_hidden = True
    runner.forward(torch.tensor(context))
    features = runner.hidden.to(proposer.parts.dtype)
    if shift:
        features = torch.cat([features[:shift], features[:-shift]])
    head, parts = proposer.head, proposer.parts
    n = len(context) - 1  # entry t reads (f_t, token t+1)
    cos, sin = parts.rope(torch.arange(n))
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out, keys, values = head(features[:n], parts.embed(torch.tensor(context[1:])), cos, sin, mask)
    feature, tokens, all_logits = out[-1], [], []
    for d in range(1, depth + 1):
        logits = parts.logits(feature[None])[0]
        token = parts.to_vocab(logits.argmax()[None])
        tokens.append(int(token))
        all_logits.append(logits)
        cos, sin = parts.rope(torch.tensor([n + d - 1]))
        mask = torch.ones(1, keys.shape[1] + 1, dtype=torch.bool)
        step, k, v = head(feature[None], parts.embed(token), cos, sin, mask, (keys, values))
        feature, keys, values = step[0], torch.cat([keys, k], 1), torch.cat([values, v], 1)
    return tokens, torch.stack(all_logits)


@pytest.mark.parametrize("tree_nodes", [None, 4])
def test_the_head_drafts_from_the_right_feature_rows(large_target, head_dir, tree_nodes):
    """A silent failure guard: every draft the proposer makes during decoding (its features handed over by the
    verify passes, its cache kept across rounds) is the head's output recomputed from scratch from the target's
    features of the same context — the whole chain, or a tree's first level (the head's top guesses); the same
    features shifted by one position give other logits (the control)."""
    proposer = EagleProposer(large_target, head=head_dir, tree_nodes=tree_nodes, dtype=torch.float32, int8=False)
    seen = []
    inner = proposer.propose

    def recording(context, k, params, generator):
        draft = inner(context, k, params, generator)
        seen.append((list(context), draft))
        return draft

    proposer.propose = recording
    out = sd.SpeculativeDecoder(large_target, proposer, gamma=4).generate(PROMPTS[2], GREEDY)
    assert out.token_ids == sd.autoregressive_generate(large_target, PROMPTS[2], GREEDY).token_ids
    assert len(seen) >= 5 and out.stats.accepted > 0
    for context, draft in seen:
        if not len(draft.tokens):  # nothing drafted (the last token's round)
            continue
        if tree_nodes is None:
            tokens, logits = _drafts_from_scratch(proposer, large_target, context, len(draft.tokens))
            assert tokens == draft.tokens.tolist(), f"after {len(context)} tokens"
        else:
            _, logits = _drafts_from_scratch(proposer, large_target, context, 1)
            first_level = draft.tokens[draft.parents == -1]
            top = proposer.parts.to_vocab(logits[0].topk(len(first_level)).indices)
            assert first_level.tolist() == top.tolist(), f"after {len(context)} tokens"
        _, shifted = _drafts_from_scratch(proposer, large_target, context, logits.shape[0], shift=1)
        assert not torch.allclose(shifted, logits, atol=1e-3)


class MisreportedDraftLaw(EagleProposer):
    """WRONG (the control): guesses drawn from the head's law q, but verified against 0.8 q + 0.2 uniform on q's
    support, a head that misstates its own law by 20%."""

    def propose(self, context, k, params, generator):
        draft = super().propose(context, k, params, generator)
        if draft.probs is None:
            return draft
        support = draft.probs > 0
        misstated = 0.8 * draft.probs + 0.2 * support / support.sum(-1, keepdim=True)
        return sd.Draft(draft.tokens, misstated, draft.parents)


ENUMERATED = sd.SamplingParams(temperature=0.8, top_k=4, max_new_tokens=4)


@pytest.mark.parametrize(
    ("case", "tree_nodes", "prompt"),
    [
        ("chain", None, PROMPTS[0]),
        ("chain-sharpened", None, PROMPTS[0]),
        ("tree", 4, PROMPTS[1]),
        ("misstated-law-control", None, PROMPTS[0]),
        ("tree-residual-control", 4, PROMPTS[1]),
    ],
)
@pytest.mark.parametrize("path", ["torch", "kernels"])
def test_eagle_laws_enumerated_exactly(large_target, head_dir, case, tree_nodes, prompt, path, monkeypatch):
    """The engine's exact law of the first two tokens (every decision enumerated, ``enumeration.engine_law``):
    EAGLE's sampled chain (also drafting at 0.6 of the request's temperature) and its top-k tree give the target's
    to float32 rounding (TV < 1e-5; measured ~1e-8 on the native runner, up to ~6e-7 on transformers').
    The controls — a head misstating its law by 20%; the tree's residuals mixed 1% with the target's law — are
    off by TV ≈ 4.6e-4 and 8e-4, far below what sampling could see (the strong tier detects 0.02). (On an Intel
    Xeon with AMX and transformers 5.25 a 3% misstatement moved TV by only 6.5e-5, so the control misstates more.)
    On the torch verification path and through the compiled ops (both controls reach either: the misstated q is what
    the chain op is given, the tree's residual is torch code)."""
    from specdecode.exactness.enumeration import engine_law, prefix_law, total_variation

    if path == "kernels":
        use_build("native", monkeypatch)

    if case == "tree-residual-control":
        correct = sd.verify._residual
        monkeypatch.setattr(
            sd.verify, "_residual", lambda p, q, x: 0.99 * (r := correct(p, q, x)) / r.sum() + 0.01 * p / p.sum()
        )
    kind = MisreportedDraftLaw if case == "misstated-law-control" else EagleProposer
    factor = 0.6 if case == "chain-sharpened" else None
    proposer = kind(large_target, head=head_dir, tree_nodes=tree_nodes, temperature_factor=factor)
    decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=1)
    if tree_nodes:
        decoder.gamma = 3
    result = engine_law(decoder, prompt, ENUMERATED, tokens=2, through_kernels=path == "kernels")
    tv = total_variation(result.law, prefix_law(large_target, prompt, ENUMERATED, tokens=2))
    assert result.accepted_mass > 0.1, result.accepted_mass
    if case.endswith("control"):
        assert tv > 1e-4, tv
    else:
        assert tv < 1e-5, tv


def test_the_calibration_measures_the_proposers_first_guess_acceptance(large_target, head_dir):
    """``temperature_overlaps`` at depth 1, factor f, equals the mean over a text's positions of sum min(p, q),
    q the law the proposer drafts its first guess from with ``temperature_factor=f`` and p the target's: the
    calibration measures what drafting does (float32 features both ways)."""
    from specdecode.heads.model import lm_head_rows
    from specdecode.training.calibrate import overlap, temperature_overlaps

    text = PROMPTS[2] + PROMPTS[0]
    runner = large_target.new_runner()
    runner.capture_hidden = True
    logits = runner.forward(torch.tensor(text))
    features = runner.hidden
    params = sd.SamplingParams(temperature=0.8)
    for factor in (0.7, 1.3):
        proposer = EagleProposer(
            large_target, head=head_dir, dtype=torch.float32, int8=False, temperature_factor=factor
        )
        direct = []
        for n in range(2, len(text) + 1):  # the proposer holds text[:n] and the features of text[:n-1]
            proposer.observe_target([features[: n - 1]])
            q = proposer.propose(text[:n], 1, params, torch.Generator().manual_seed(n)).probs[0]
            p = torch.softmax(logits[n - 1].float() / params.temperature, -1)
            direct.append(float(overlap(p, q)))
        parts, rows = proposer.parts, lm_head_rows(large_target.model)[: large_target.vocab_size]
        sequence = (features, torch.tensor(text), torch.arange(len(text)))
        measured = temperature_overlaps(proposer.head, parts, rows, [sequence], (0.8,), (factor,), depths=1)
        assert measured[0.8][factor][0] == pytest.approx(sum(direct) / len(direct), abs=2e-4)


def test_train_head_stores_a_calibration_the_proposer_reads(large_target, head_dir):
    import json

    stored = json.loads((head_dir / "config.json").read_text())["sampling_calibration"]
    assert stored["temperatures"] == [0.6, 0.8, 1.0, 1.2]
    for t, f in zip(stored["temperatures"], stored["factors"], strict=True):
        by_factor = stored["overlap_by_factor"][str(t)]
        assert by_factor[str(f)][0] == max(v[0] for v in by_factor.values())  # the best depth-1 overlap
    proposer = EagleProposer(large_target, head=head_dir)
    assert proposer.calibration.factor(0.8) == stored["factors"][1]
    assert EagleProposer(large_target, head=head_dir, temperature_factor=1.0).calibration.factor(0.8) == 1.0
    with pytest.raises(ValueError, match="temperature_factor"):
        EagleProposer(large_target, head=head_dir, temperature_factor=0.0)
