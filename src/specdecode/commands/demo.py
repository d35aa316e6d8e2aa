"""``specdecode demo``: one prompt that reuses its input, decoded plainly and speculatively."""

from __future__ import annotations

import statistics
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdecode import factory
from specdecode.commands import quiet_transformers
from specdecode.commands.options import (
    DtypeOption,
    GammaOption,
    GroupSizeOption,
    HeadOption,
    HeadsOption,
    MaxNewTokensOption,
    QuantizationOption,
    TargetOption,
    TreeNodesOption,
    parse_gamma,
)

PASSAGE = (
    "The city council met on Tuesday evening to discuss the new public library. After a long debate, the "
    "council voted to approve a budget of two million dollars for the building, which will be constructed "
    "on the empty lot next to the central train station. The library will have a reading room, a children's "
    "section, a computer lab and a small cafe. Construction is expected to begin in the spring and to be "
    "finished within eighteen months. The mayor said that the library would be a place for everyone in the "
    "city to learn, to meet and to read."
)
PROMPT = (
    "Rewrite the following passage in the past perfect where it fits, changing as little as possible. "
    "Return only the rewritten passage.\n\n" + PASSAGE
)
ROUNDS = 2
NAMES = {"lookup": "prompt lookup", "eagle": "EAGLE head", "medusa": "Medusa heads", "suffix": "suffix decoding"}


ProposerOption = Annotated[
    str,
    typer.Option(
        help="lookup (prompt lookup), eagle (a trained draft head), medusa (trained Medusa heads) or suffix (suffix "
        "decoding; here it does not remember earlier runs, which repeat the same prompt)."
    ),
]


def demo(
    target: TargetOption = "smollm2",
    gamma: GammaOption = "auto",
    proposer: ProposerOption = "lookup",
    max_new_tokens: MaxNewTokensOption = 160,
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
    head: HeadOption = None,
    tree_nodes: TreeNodesOption = None,
    heads: HeadsOption = None,
) -> None:
    """Edit a pasted passage plainly and speculatively; show the outputs match and the measured speedup."""
    from specdecode import SamplingParams, SpeculativeDecoder, autoregressive_generate

    quiet_transformers()
    parsed_gamma = parse_gamma(gamma)  # validate before the slow load
    if proposer not in NAMES:
        raise ValueError(f"--proposer must be lookup, eagle, medusa or suffix, got {proposer!r}")
    console = Console()
    with console.status(f"loading {target} (the first load dequantizes and caches it)…"):
        model = factory.load(target, dtype, quantization, group_size)
        if proposer == "suffix":  # each run alone: remembering the last run's answer would copy it whole
            chosen = factory.suffix_proposer(None, tree_nodes, remember=False)
        else:
            chosen = factory.build_proposer(proposer, model, None, head=head, tree_nodes=tree_nodes, heads=heads)
    ids = model.chat_prompt(PROMPT)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    decoder = SpeculativeDecoder(model, chosen, gamma=parsed_gamma)
    console.print(f"[bold]Prompt[/bold] ({len(ids)} tokens, greedy, {max_new_tokens} new tokens at most):")
    console.print(PROMPT, highlight=False)
    with console.status("warming up…"):
        warm = SamplingParams(max_new_tokens=8)
        autoregressive_generate(model, ids, warm)
        decoder.generate(ids, warm)
    plain_runs, spec_runs = [], []
    with console.status("decoding plain and speculative, alternately…"):
        for _ in range(ROUNDS):
            plain_runs.append(autoregressive_generate(model, ids, params))
            spec_runs.append(decoder.generate(ids, params))
    plain, spec = plain_runs[0], spec_runs[0]
    identical = all(r.token_ids == plain.token_ids for r in plain_runs + spec_runs)
    plain_tps = statistics.median(r.stats.tokens_per_second for r in plain_runs)
    spec_tps = statistics.median(r.stats.tokens_per_second for r in spec_runs)
    console.print("\n[bold]Output[/bold]:")
    console.print(spec.text, highlight=False)
    weights = model.quantization or "dense"
    table = Table(
        title=f"{model.name} ({weights} weights), {NAMES[proposer]}, "
        f"gamma={parsed_gamma} "
        f"(median of {ROUNDS} alternating runs)"
    )
    for column in ("method", "tokens", "tok/s", "passes", "tok/pass", "accept", "α"):
        table.add_column(column, justify="right")
    table.add_row("plain", str(len(plain.token_ids)), f"{plain_tps:.1f}", str(plain.stats.rounds), "1.00", "-", "-")
    s = spec.stats
    table.add_row(
        "speculative",
        str(len(spec.token_ids)),
        f"{spec_tps:.1f}",
        str(s.rounds),
        f"{s.tokens_per_round:.2f}",
        f"{s.acceptance_rate:.1%}",
        f"{s.alpha:.2f}",
    )
    console.print(table)
    verdict = "[green]identical[/green]" if identical else "[red]DIFFERENT[/red]"
    console.print(
        f"Outputs token for token: {verdict}.  Measured speedup: [bold]{spec_tps / plain_tps:.2f}×[/bold]"
        f"  (acceptance rate {s.acceptance_rate:.1%}, {s.tokens_per_round:.2f} tokens per target pass)"
    )
