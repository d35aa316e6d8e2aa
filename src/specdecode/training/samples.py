"""The sequences a head trains on: a data set's samples tokenized in windows, split into held-out and training
sequences (``read_samples``), and the drafting vocabulary chosen from them."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..models.loaded import LoadedModel
from . import windows
from .data import DataStats, Sample, iter_samples, spec_bench_questions

if TYPE_CHECKING:
    from .features import FeatureCache


class DataSettings(Protocol):
    """What reading the samples takes of a run's settings (``train.TrainSettings``, ``medusa.MedusaSettings``)."""

    data: str
    limit: int | None
    limit_tokens: int | None
    held_out: int
    skip: int
    max_length: int
    spec_bench: str | None


def check_limits(settings: DataSettings) -> None:
    """``limit`` and ``limit_tokens`` are positive integers or None; ``skip`` an integer >= 0."""
    for name in ("limit", "limit_tokens"):
        value = getattr(settings, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if isinstance(settings.skip, bool) or not isinstance(settings.skip, int) or settings.skip < 0:
        raise ValueError(f"skip must be an integer >= 0, got {settings.skip!r}")


def tokenize(target: LoadedModel, sample: Sample, max_length: int) -> list[int]:
    """Token ids of a chat (the target's chat template, or the turns' text joined by newlines without one) or a
    text: the first of its ``token_windows``."""
    return token_windows(target, sample, max_length)[0]


def token_windows(target: LoadedModel, sample: Sample, max_length: int) -> list[list[int]]:
    """A text's ids in consecutive windows of ``max_length`` tokens, a chat's in windows of whole exchanges
    (``windows.token_windows``): a long document or a long chat trains as many samples, not one cut short."""
    return windows.token_windows(target, sample, max_length)


def read_samples(target: LoadedModel, settings: DataSettings) -> tuple[list[list[int]], list[list[int]], DataStats]:
    """(held-out sequences, training sequences, reader stats): the first ``held_out`` usable sequences are held
    out, the next ``skip`` are left out, the next ``limit`` train (a text gives one per ``max_length`` window),
    stopping at the first sequence that brings the training tokens to ``limit_tokens`` (so runs on different
    data can be compared at equal tokens). Sequences shorter than 4 tokens are skipped."""
    if target.tokenizer is None:
        raise ValueError("training a head needs the target's tokenizer")
    stats = DataStats()
    first_train = settings.held_out + settings.skip
    wanted = None if settings.limit is None else first_train + settings.limit
    sequences: list[list[int]] = []
    train_tokens = 0

    def enough() -> bool:
        full = wanted is not None and len(sequences) >= wanted
        return full or (settings.limit_tokens is not None and train_tokens >= settings.limit_tokens)

    for sample in iter_samples(settings.data, spec_bench_questions(settings.spec_bench), stats):
        for ids in token_windows(target, sample, settings.max_length):
            if len(ids) >= 4 and not enough():
                sequences.append(ids)
                train_tokens += len(ids) if len(sequences) > first_train else 0
        if enough():
            break
    stats.sequences = len(sequences)
    if len(sequences) <= first_train:
        skipped = f", {settings.skip} skipped" if settings.skip else ""
        raise ValueError(
            f"{settings.data} gave {len(sequences)} usable sequences of at most {settings.max_length} tokens: not "
            f"enough for {settings.held_out} held out{skipped} plus training (lower --held-out or add data)"
        )
    return sequences[: settings.held_out], sequences[first_train:], stats


def choose_draft_vocab(sequences: list[list[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` (0: all) token ids most frequent in ``sequences``, most frequent first (ties by id)."""
    counts = Counter(t for seq in sequences for t in seq)
    ranked = sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t))
    return torch.tensor(ranked[: size or vocab_size], dtype=torch.int64)


def rank_by_target(draft_vocab: torch.Tensor, target_counts: torch.Tensor) -> torch.Tensor:
    """``draft_vocab`` reordered by how often each id was the target's argmax in training (ties: kept order), so
    that its first N ids are the best drafting vocabulary of size N."""
    order = torch.sort(-target_counts[draft_vocab], stable=True).indices
    return draft_vocab[order]


def data_record(
    stats: DataStats, train: list[list[int]], held_out: list[list[int]], cache: FeatureCache, unit: str
) -> dict[str, Any]:
    """The ``data`` entry of a trained head's config: what the reader read and kept (``unit``: what the config calls
    a training sequence, ``samples`` or ``sequences``) and the features cached."""
    return {
        "samples_read": stats.samples,
        "spec_bench_excluded": stats.excluded,
        "spec_bench_checked": stats.spec_bench_checked,
        f"train_{unit}": len(train),
        "train_tokens_per_epoch": sum(len(s) for s in train),
        f"held_out_{unit}": len(held_out),
        "held_out_tokens": sum(len(s) for s in held_out),
        "features_cached_bytes": cache.stored_bytes,
        "sequences_not_cached": len(cache.uncached),  # recomputed when needed: past cache_bytes
    }
