"""`specdecode train-medusa`: train Medusa heads for a target on this machine's CPU (self-distilled)."""

from __future__ import annotations

from typing import Annotated

import typer

from specdecode import factory
from specdecode.commands import cache_bytes, cache_summary, err, quiet_transformers, set_threads, training_reporter
from specdecode.commands.options import (
    BatchTokensOption,
    CacheGbOption,
    CheckpointEveryOption,
    DraftVocabOption,
    EpochsOption,
    HeldOutOption,
    LrOption,
    MaxLengthOption,
    ResumeOption,
    SpecBenchOption,
    TargetOption,
    TokensOption,
    TrainDataOption,
    TrainLimitOption,
    TrainOutOption,
    TrainSeedOption,
    TrainThreadsOption,
)
from specdecode.training.data import HELD_OUT

HeadsOption = Annotated[
    int, typer.Option(help="Medusa heads K: head i guesses the token i+2 positions past the feature read.")
]


def train_medusa(
    out: TrainOutOption,
    target: TargetOption = "smollm2",
    data: TrainDataOption = "sharegpt",
    heads: HeadsOption = 3,
    limit: TrainLimitOption = None,
    tokens: TokensOption = None,
    held_out: HeldOutOption = HELD_OUT,
    epochs: EpochsOption = 1,
    resume: ResumeOption = False,
    seed: TrainSeedOption = 0,
    max_length: MaxLengthOption = 1024,
    batch_tokens: BatchTokensOption = 2048,
    lr: LrOption = 1e-3,
    draft_vocab: DraftVocabOption = 0,
    checkpoint_every: CheckpointEveryOption = 100,
    spec_bench: SpecBenchOption = None,
    threads: TrainThreadsOption = None,
    cache_gb: CacheGbOption = 20.0,
) -> None:
    """Train Medusa heads on a frozen target: each head learns the target's own law a few positions ahead."""
    from specdecode.training.medusa import MedusaSettings
    from specdecode.training.medusa import train_medusa as run

    set_threads(threads)
    max_cache = cache_bytes(cache_gb)
    settings = MedusaSettings(
        data=data,
        limit=limit,
        limit_tokens=tokens,
        held_out=held_out,
        max_length=max_length,
        epochs=epochs,
        batch_tokens=batch_tokens,
        heads=heads,
        lr=lr,
        draft_vocab=draft_vocab,
        checkpoint_every=checkpoint_every,
        seed=seed,
        spec_bench=spec_bench,
    )
    quiet_transformers()
    with err.status(f"loading {target}…"):
        model = factory.load(target, "float32", "none")
    bar, on_start, on_step = training_reporter(max_length, "head-0 acc")
    with bar:
        result = run(model, settings, out, resume=resume, on_step=on_step, on_start=on_start, cache_bytes=max_cache)
    print(f"saved {result.folder}: {result.steps} steps, {result.tokens:,} tokens, {result.elapsed:.0f} s")
    print(cache_summary(result.data))
    for size, figures in result.by_vocab.items():
        top1 = " ".join(f"{a:.3f}" for a in figures["top1_by_head"])
        print(
            f"drafting from {size} ids (covering {figures['coverage']:.1%} of the target's tokens): held-out top-1 "
            f"agreement with the target, heads 0..{len(figures['top1_by_head']) - 1} (tokens 2.. ahead): {top1}"
        )
