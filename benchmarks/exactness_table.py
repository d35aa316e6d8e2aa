"""docs/EXACTNESS.md's tables, generated (not typed): "production path × promise → test, power, control", the
engine-level tests' power (``--power``) and the engine's enumerated laws (``--laws``).

Each row of the first names its tests as ``module::function``; the script imports the test modules, fails if a named
test is gone, and reads the bounds and false-alarm rates from the modules' own constants, so the table cannot drift
from the code silently (tests/exactness/test_exactness_table.py checks that the doc holds this output). Run from the
repository root:

    PYTHONPATH=src .venv/bin/python benchmarks/exactness_table.py            # print the table
    PYTHONPATH=src .venv/bin/python benchmarks/exactness_table.py --write    # replace it in docs/EXACTNESS.md
    PYTHONPATH=src .venv/bin/python benchmarks/exactness_table.py --power    # the power table
    PYTHONPATH=src .venv/bin/python benchmarks/exactness_table.py --laws     # the enumeration table

``--power``: for each engine-level test, its law's pooled cells at its sample size, its per-test threshold, the TV it
detects with probability 0.9 (``exactness.detectable_tv``) and the draws it would need for TV 0.05 and 0.02. No
sampling: the laws are computed, the pooling depends on N only.
``--laws``: the test suite's exact engine laws (``enumeration.engine_law``): for each law and warp, the runs it took,
the seconds, the probability that a guess was accepted on the way and the total variation from the target's own
law; then the minimally biased controls' TV (rows printed as they are computed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "EXACTNESS.md"
BEGIN = "<!-- exactness_table.py: begin -->"
END = "<!-- exactness_table.py: end -->"
POWER_BEGIN = "<!-- exactness_table.py --power: begin -->"
POWER_END = "<!-- exactness_table.py --power: end -->"


def _module(name: str):
    """A test module by its name, imported as pytest imports it (its folder on ``sys.path``; names are unique), or a
    module under tests/ (``helpers.models``)."""
    folders = [ROOT / "tests"] + [path.parent for path in (ROOT / "tests").rglob(f"{name}.py")]
    for folder in map(str, folders):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    return importlib.import_module(name)


def test(ref: str) -> str:
    """``module::function`` as a cell, after checking that the test exists."""
    module, function = ref.split("::")
    if not callable(getattr(_module(module), function, None)):
        raise SystemExit(f"exactness_table.py: {ref} is gone; update the table's rows")
    return f"`{module}::{function}`"


def constant(module: str, name: str):
    return getattr(_module(module), name)


Row = tuple[str, str, str, str, str]


def rows() -> list[Row]:
    """(production path, promise, tests, power, controls)."""
    return _compiled_rows() + _engine_rows() + _serving_and_identity_rows()


def _compiled_rows() -> list[Row]:
    """The compiled sampling ops, and the engine's laws enumerated through them."""
    kernel_tol = constant("test_kernel_laws", "TOLERANCE")
    margin = constant("test_kernel_laws", "MARGIN")
    bound = constant("test_enumeration", "BOUND")
    return [
        (
            "compiled chain rule (`exact_chain`, float32 CPU rows: every sampled chain round)",
            "accept min(1, p/q); residual norm(max(0, p − q)); bonus p",
            test("test_kernel_laws::test_exact_chain_draws_the_promised_law"),
            f"exact: interval lengths by bisection, max deviation ≤ {kernel_tol:g} at V 8 / 49,157 / 262,144 "
            "(49,157: a last block of 5 entries); accept thresholds = p/q to the bit",
            f"{test('test_kernel_laws::test_control_a_biased_chain_kernel_is_caught')}: p mixed 1% uniform, p 1% "
            f"toward q, residual mixed 1% with p, index shift — each missed by > {margin}× the bound (≥ 5e-4); "
            f"{test('test_kernel_laws::test_control_a_mutant_build_of_the_kernels_is_caught')}: faults compiled in "
            f"(`kernels.MUTANTS`: residual + 1% p, index shift, accept iff u ≤ p/q, a point mass's residual keeping "
            f"its guess, the eps fallback at 1e-3, draws never reaching a last partial block), each on a case the "
            f"real build passes — missed by > {margin}× the bound, the ≤ by a threshold that is not p/q",
        ),
        (
            "compiled inverse-CDF draw (`inverse_cdf_rows`: proposers, plain sampling, bonus)",
            "a draw follows p",
            test("test_kernel_laws::test_inverse_cdf_rows_draws_p"),
            f"exact, ≤ {kernel_tol:g} at V 8 / 49,157 / 262,144",
            f"{test('test_kernel_laws::test_control_a_biased_inverse_cdf_kernel_is_caught')}: p mixed 1% uniform, "
            "index shift; the index-shifting and block-walk mutant builds",
        ),
        (
            "compiled sampling on every instruction set (AVX2 and plain-C builds against this machine's)",
            "`exact_chain` and `inverse_cdf_rows` give the same tokens, float32 rows, V 8 / 49,157",
            test("test_kernels::test_every_instruction_set_samples_the_same_tokens"),
            "bitwise, at random uniforms and at every tested boundary ± 1e-12, a guess with p = 0 at u = 0, a "
            "residual of mass 5e-5",
            "the same test: each mutant build gives other tokens; a mutant that does not build fails the test "
            "where the native one builds (never a skip); `SPECDECODE_KERNELS=mutant_*` is refused outside the tests",
        ),
        (
            "engine through the compiled ops (`engine_law(through_kernels=True)`: decisions read off `exact_chain` / "
            "`inverse_cdf_rows` by bisection)",
            "a draft model's chain (T 1): first token; point-mass chain and tree: first two tokens = the target's; "
            "at V = 150 (three 64-entry blocks, the last partial; T 1, top-k 8) a draft model's chain and prompt "
            "lookup's (first token; first two)",
            f"{test('test_enumeration_kernels::test_a_draft_models_chain_through_the_compiled_ops_gives_the_targets_law')}, "  # noqa: E501
            f"{test('test_enumeration_kernels::test_point_mass_laws_through_the_compiled_ops')}, "
            f"{test('test_enumeration_kernels::test_laws_across_several_blocks_through_the_compiled_ops')}",
            f"exact, TV < {bound:g}",
            "the mutant builds (`SPECDECODE_KERNELS=mutant_*`): residual + 1% p (TV 6.1e-3), index shift "
            "(TV 0.37–0.84); the chain op's residual draw mixed 1% with p (TV 0.019); at V = 150 the block-walk build "
            "and the residual / point-mass builds (each > 100× the bound)",
        ),
        (
            "layer-skip self-drafts, γ = 1, 2, 3 (through the compiled ops, T 1, top-k 2)",
            "law of the first two tokens = the target's",
            test("test_layer_skip::test_layer_skip_drafts_give_the_targets_law_exactly"),
            f"exact, TV < {constant('test_layer_skip', 'LAW_BOUND'):g}",
            "the same test: the residual-mixing mutant build (TV 6.2–6.6e-3)",
        ),
        (
            "hybrids: prompt lookup or suffix decoding + a layer-skip model, γ 3 (both sides drafting)",
            "law of the first two tokens = the target's",
            test("test_hybrid::test_hybrid_laws_are_the_targets_exactly"),
            f"exact, TV < {constant('test_layer_skip', 'LAW_BOUND'):g}",
            "the same test: the residual-mixing mutant build (TV 5.9–6.3e-3)",
        ),
    ]


def _engine_rows() -> list[Row]:
    """The engine's laws: enumerated on the torch path, sampled at CI size and at release strength."""
    bound = constant("test_enumeration", "BOUND")
    engine_alpha = constant("test_decoder", "ALPHA")
    strong_tv, strong_alpha = constant("test_check_strong", "TV"), constant("test_check_strong", "ALPHA")
    engine_family = 2 * len(constant("test_decoder", "WARPS")) * 2 * 2 * engine_alpha  # kinds×warps×tests×backends
    return [
        (
            "chain rule, torch path (float64 rows, any `Choices`)",
            "first token ~ p; accept Σ min(p, q)",
            test("test_enumeration::test_the_enumerator_gives_the_chain_rule_its_exact_law"),
            "exact, 1e-15",
            f"{test('test_verify::test_negative_control_the_first_token_test_detects_a_wrong_residual')} (sampled)",
        ),
        (
            "engine, point-mass chains and trees (prompt lookup, suffix, deterministic trees), T1 / top-k / top-p",
            "law of the first two tokens = the target's",
            test("test_enumeration::test_point_mass_laws_are_the_targets_exactly"),
            f"exact, TV < {bound:g}, on the torch path and through the compiled ops",
            f"{test('test_enumeration::test_a_residual_biased_by_one_percent_is_caught')}: residual mixed 1% "
            "(torch path: TV 1.4–3.3e-3); through the compiled ops the chain's: the point-mass mutant build",
        ),
        (
            'engine, `gamma="auto"` in exact mode (fixed cost model)',
            "law of a whole 4-token request = plain sampling's",
            test("test_enumeration_paths::test_gamma_auto_in_exact_mode_gives_the_targets_law"),
            f"exact, TV < {bound:g}, on the torch path and through the compiled ops",
            "the same test's controls: residual mixed 1% (TV 2.5e-3); the index-shifting build (compiled path)",
        ),
        (
            "engine, top-k with top-p; T = 1.5 (chain and tree)",
            "law of the first two tokens",
            test("test_enumeration_paths::test_warped_laws_are_the_targets_exactly"),
            f"exact, TV < {bound:g}, on the torch path and through the compiled ops",
            "the same test's controls: residual mixed 1% (torch path: TV 2.4–3.3e-3); through the compiled ops the "
            "chain's point-mass-residual build; top-p before top-k (TV 0.028–0.098)",
        ),
        (
            "engine output: an EOS / a stop string inside an accepted run",
            "output (ids, text) law = plain sampling's, cut there, bonus dropped",
            test("test_enumeration_paths::test_an_eos_or_stop_string_inside_an_accepted_run_ends_the_output_exactly"),
            f"exact, TV < {bound:g}, on the torch path and through the compiled ops",
            "the same test's control: a sink keeping the round whole (TV 0.13)",
        ),
        (
            "engine, draft model's sampled chain and sampled trees (CI sizes, both runners, compiled chain path)",
            "law of the first two tokens",
            f"{test('test_decoder::test_first_two_tokens_follow_the_target_exactly')}, "
            f"{test('test_enumeration::test_sampled_drafts_give_the_targets_law')} (slow)",
            f"χ² at {engine_alpha:g} a test (family {engine_family:.1%}, the `backend` fixture doubling), detects "
            "TV ≥ 0.11–0.14 at 90%; slow: exact, TV < 1e-6",
            f"{test('test_decoder::test_negative_control_a_wrong_verifier_is_caught')} (resample from p: gross); slow: "
            "q misstated 3% (TV 0.017)",
        ),
        (
            "engine, every sampled law at release strength (opt-in `SPECDECODE_STRONG=1`)",
            "first token and joint of two",
            test("test_check_strong::test_every_law_at_the_size_that_catches_tv_002"),
            f"detects TV ≥ {strong_tv:g} at 90%, family false alarm {strong_alpha:.0%}",
            f"{test('test_check_strong::test_a_minimally_biased_residual_is_caught')}: residual mixed 15% — "
            "draft-model and lookup chains through the compiled chain op, a point-mass tree through `_residual`, each "
            "asserted reached (issue 53)",
        ),
    ]


def _serving_and_identity_rows() -> list[Row]:
    """The server's modes, the heads' laws, row invariance, and the identities resting on it."""
    return [
        (
            "the server, exact mode: 16 concurrent requests, mixed proposers (lookup chains and trees, layer skip, "
            "plain) in the same batched passes",
            "each seeded request's output = the engine's (so the engine's exact laws hold for it)",
            test("test_serving_exact::test_exact_mode_under_concurrency_gives_each_request_the_engines_output"),
            "token for token; batches checked to form",
            "the same test: rejections resampled from p",
        ),
        (
            'the server, reproducible mode, the same batches, under `policy="always"` and the default `"auto"`',
            "text and logprobs (top 2 included) = plain sampling's, same seed",
            test("test_serving_exact::test_reproducible_mode_under_concurrency_gives_plain_sampling_text_and_logprobs"),
            "bitwise",
            "the same test: a coupled rule keeping every guess",
        ),
        (
            "EAGLE chain and tree; Medusa chain and tree",
            "law of the first two tokens",
            f"{test('test_eagle::test_eagle_laws_enumerated_exactly')}, "
            f"{test('test_medusa::test_medusa_laws_enumerated_exactly')}",
            "exact, TV < 1e-5 (the transformers runner's rounding reached 1.05e-6: a56cf86), on the torch path and "
            "through the compiled ops",
            "a head misstating its law by 20% (TV 4.6e-4); tree residuals mixed 1%; Medusa's chain residual (torch: "
            "mixed 1%; compiled: the point-mass mutant build)",
        ),
        (
            "native runner, every weight format and dtype (and the server's 144-row batches)",
            "row invariance: a k-row pass is bitwise k one-row steps",
            f"{test('test_native_llama::test_k_token_pass_is_bitwise_k_single_steps')}, "
            f"{test('test_row_invariance_sizes::test_a_144_row_batch_gives_each_request_its_own_steps_bitwise')}",
            "bitwise",
            f"{test('test_row_invariance_control::test_control_a_runner_that_rounds_differently_for_k_rows_fails_the_bitwise_check')}: "  # noqa: E501
            "1 ulp on one logit; a reassociated sum",
        ),
        (
            "GGUF load path (blocks from the file) and a Gemma 3 GGUF, its 262,144-token head included",
            "row invariance",
            test("test_row_invariance_control::test_the_gguf_load_path_is_row_invariant_at_every_chunk"),
            "bitwise, k 1..16",
            "the same test: the 1-ulp runner fails there",
        ),
        (
            "5-bit GGUF blocks (Q5_0, Q5_1, Q5_K) held as nibbles plus a plane of fifth bits",
            "the byte format's logits, on the native and AVX2 builds; row invariance",
            f"{test('test_kernels::test_five_bit_blocks_in_nibbles_and_high_bits_give_the_one_byte_layouts_bits')}, "
            f"{test('test_gguf_load::test_five_bit_blocks_held_in_high_bit_planes_give_the_one_byte_formats_logits_in_less_memory')}",  # noqa: E501
            "bitwise",
            "the first test: one flipped fifth bit moves exactly that output",
        ),
        (
            "penalties, logit_bias and min_p (each verified row warped with its own context's counts)",
            "law of the first two tokens = plain sampling's with the same warps; greedy and reproducible identity",
            f"{test('test_warps::test_warped_laws_are_plain_samplings_exactly')}, "
            f"{test('test_warps::test_greedy_speculation_equals_plain_decoding_with_each_warp')}, "
            f"{test('test_warps::test_reproducible_mode_equals_plain_sampling_with_each_warp')}",
            "exact, TV < 1e-06, on the torch path and through the compiled ops; token for token",
            "counts one row late; context warps on row 0 only; min_p before temperature (each > 100× the bound); "
            f"{test('test_warps::test_greedy_identity_fails_with_the_counts_one_row_late')}",
        ),
        (
            "a grammar (structured output): each verified row masked in its own grammar state",
            "law = plain constrained sampling's (chain, tree, sampled drafts; a grammar forcing tokens, drafted free "
            "at a round's head); greedy and reproducible identity",
            f"{test('test_structured_law::test_the_law_under_a_grammar_is_plain_constrained_samplings')}, "
            f"{test('test_structured_law::test_the_law_with_forced_tokens_is_plain_constrained_samplings')}, "
            f"{test('test_structured::test_greedy_and_reproducible_outputs_equal_plain_decodings')}",
            "exact, TV < 1e-06, on the torch path and through the compiled ops; token for token",
            f"{test('test_structured_law::test_a_mask_applied_one_row_late_is_caught')}, and the forced-token test's "
            "own (> 100× the bound)",
        ),
        (
            "a reused prefix (the library's next turn, the server's prefix cache: rows copied between runners)",
            "logits and text = a full prefill's",
            f"{test('test_kv_rows::test_rows_copied_into_another_runner_continue_bitwise_even_when_the_hit_ends_mid_block')}, "  # noqa: E501
            f"{test('test_prefix_reuse::test_each_turn_reuses_the_history_and_equals_a_fresh_decoder')}, "
            f"{test('test_prefix_cache_server::test_a_hit_after_a_finished_request_is_bitwise_plain_decoding')}",
            "bitwise; token for token",
            f"{test('test_kv_rows::test_control_one_scaled_row_or_other_tokens_rows_change_the_logits')}, "
            f"{test('test_prefix_cache_server::test_control_corrupted_cached_rows_change_the_logprobs')}",
        ),
        (
            "greedy speculation (chains, trees, every weight format)",
            "identity with plain greedy decoding",
            f"{test('test_decoder::test_greedy_output_is_identical_to_plain_decoding')}, "
            f"{test('test_tree::test_greedy_tree_output_is_plain_decoding')}",
            "token for token",
            "none direct; rests on row invariance (its control above)",
        ),
        (
            '`mode="reproducible"` (chains, trees, `gamma="auto"`)',
            "identity with plain sampling, same seed",
            f"{test('test_reproducible::test_reproducible_equals_plain_sampling_for_every_proposer')}, "
            f"{test('test_tree::test_reproducible_tree_output_is_plain_sampling')}",
            "token for token",
            "none direct; rests on row invariance",
        ),
    ]


def table() -> str:
    lines = [
        BEGIN,
        "| production path | promise | test | power | control |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    lines.append(END)
    return "\n".join(lines)


def _power_row(name: str, law, samples: int, threshold: float) -> str:
    from specdecode.exactness.check import detectable_tv, pooled_shape, samples_for_tv

    dof, hidden = pooled_shape(law, samples)
    tv = detectable_tv(samples, dof, threshold, hidden=hidden)
    need = [samples_for_tv(t, dof, threshold) for t in (0.05, 0.02)]
    return (
        f"| {name} | {samples:,} | {threshold:.1e} | {dof} | {hidden:.3f} | **{tv:.3f}** | {need[0]:,} | {need[1]:,} |"
    )


def power_table() -> str:
    """The power of the suite's engine-level exactness tests at their sizes and thresholds (the test modules' own
    constants; check-exact's default family rate, halved over its two tests)."""
    import inspect

    import numpy as np
    import torch

    import specdecode as sd
    from specdecode.exactness.check import check_exactness, first_token_law, pair_law

    models, engine = _module("helpers.models"), _module("test_decoder")
    tree, check, suffix, eagle = (_module(name) for name in ("test_tree", "test_check", "test_suffix", "test_eagle"))
    default_alpha = inspect.signature(check_exactness).parameters["alpha"].default
    small = sd.load_model(models.tiny_llama(models.SMALL_VOCAB, seed=0))
    large = sd.load_model(models.tiny_llama(models.LARGE_VOCAB, seed=10))
    t1 = sd.SamplingParams(temperature=1.0)
    rows = [
        "| test (law) | samples | threshold per test | df | hidden TV | detects TV ≥ (90%) | N for 0.05 | N for 0.02 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for warp, params in engine.WARPS.items():  # test_decoder: chains (draft model, prompt lookup), 2-token joint
        joint = engine.exact_two_token_law(small, engine.LOOKUP_PROMPT, params).ravel()
        law = torch.from_numpy(np.ascontiguousarray(joint))
        rows.append(_power_row(f"test_decoder chain, {warp}, joint of 2 tokens", law, engine.SAMPLES, engine.ALPHA))
    pairs = pair_law(small, [1, 2, 3], t1, 64).probs
    first = first_token_law(small, [1, 2, 3], t1)
    for name, samples, threshold in (
        (f"test_tree ({tree.CASES // 2} trees x 2 runners)", tree.SAMPLES, tree.ALPHA / tree.CASES / 2),
        ("test_check (check-exact)", check.SAMPLES, default_alpha / 2),
    ):
        rows.append(_power_row(f"{name}, first token", first, samples, threshold))
        rows.append(_power_row(f"{name}, joint of 2 tokens", pairs, samples, threshold))
    suffix_first = first_token_law(small, [3, 9, 4], t1)
    suffix_pairs = pair_law(small, [3, 9, 4], t1, 64).probs
    for what, law in (("first token", suffix_first), ("joint of 2 tokens", suffix_pairs)):
        threshold = suffix.ALPHA / suffix.CASES / 2
        rows.append(_power_row(f"test_suffix ({suffix.CASES} cases), {what}", law, suffix.SAMPLES, threshold))
    eagle_first = first_token_law(large, [3, 17, 5, 9], t1)
    eagle_pairs = pair_law(large, [3, 17, 5, 9], t1, 64).probs
    for what, law in (("first token", eagle_first), ("joint of 2 tokens", eagle_pairs)):
        rows.append(_power_row(f"test_eagle (chain, tree), {what}", law, eagle.EXACT_SAMPLES, eagle.EXACT_ALPHA / 2))
    return "\n".join([POWER_BEGIN, *rows, POWER_END])


def _law_row(label: str, decoder, prompt: list[int], params, tokens: int = 2) -> str:
    from specdecode.exactness.enumeration import engine_law, prefix_law, total_variation

    started = time.perf_counter()
    result = engine_law(decoder, prompt, params, tokens=tokens)
    seconds = time.perf_counter() - started
    tv = total_variation(result.law, prefix_law(decoder.target, prompt, params, tokens=tokens))
    return f"| {label} | {result.runs:,} | {seconds:.2f} | {result.accepted_mass:.3f} | {tv:.1e} |"


def print_laws() -> None:
    """tests/exactness/test_enumeration.py's point-mass laws under each warp, then three with every residual mixed
    ``MIXED`` with the target's law (the controls, through ``verify._residual``)."""
    import specdecode as sd
    import specdecode.sampling.verify

    models, enumeration = _module("helpers.models"), _module("test_enumeration")
    target = sd.load_model(models.tiny_llama(models.SMALL_VOCAB, seed=0))
    print("| law | warp | runs | seconds | P(a guess accepted) | TV from the target's law |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in enumeration.POINT_MASS:
        for warp, params in enumeration.WARPED.items():
            decoder, prompt = enumeration.case(name, target)
            print(_law_row(f"{name} | {warp}", decoder, prompt, params), flush=True)
    correct, mix = specdecode.sampling.verify._residual, enumeration.MIXED

    def mixed(target_probs, draft, token):
        residual = correct(target_probs, draft, token)
        return (1 - mix) * residual / residual.sum() + mix * target_probs / target_probs.sum()

    specdecode.sampling.verify._residual = mixed
    try:
        for name in ("chain/lookup", "tree/lookup-3-branches", "tree/deep-wide-3-2"):
            decoder, prompt = enumeration.case(name, target)
            label = f"{name}, residual mixed {mix:.0%} (control) | T1"
            print(_law_row(label, decoder, prompt, enumeration.T1), flush=True)
    finally:
        specdecode.sampling.verify._residual = correct


def main() -> None:
    parser = argparse.ArgumentParser(description="docs/EXACTNESS.md's tables (default: the paths × promises one)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the generated tables in docs/EXACTNESS.md")
    mode.add_argument("--power", action="store_true", help="print the engine-level tests' power table")
    mode.add_argument("--laws", action="store_true", help="print the enumerated engine laws' table")
    args = parser.parse_args()
    if args.power:
        print(power_table())
    elif args.laws:
        print_laws()
    elif args.write:
        doc = DOC.read_text()
        for begin, end, text in ((BEGIN, END, table()), (POWER_BEGIN, POWER_END, power_table())):
            start, stop = doc.index(begin), doc.index(end) + len(end)
            doc = doc[:start] + text + doc[stop:]
        DOC.write_text(doc)
    else:
        print(table())


if __name__ == "__main__":
    main()
