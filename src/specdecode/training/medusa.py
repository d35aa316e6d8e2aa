"""Training Medusa heads (``heads.medusa``: the heads, their positions, their saved format) on a frozen target.

Self-distillation, teacher forcing over the data's text): at row t head i learns the target's own law
at row t+i+1 (its read-out of f_{t+i+1}, from the same frozen forward), loss Σ_i decay^i · CE(p_target, q_i)
over the drafting vocabulary. The data reader (``training.samples``), the feature cache (``training.features``)
and the batching, schedule and training loop with its checkpoints (``training.loop``) are EAGLE's too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..heads.medusa import FORMAT, MedusaHeads, save_heads
from ..heads.model import TargetParts, lm_head_rows, text_config
from ..heads.saved import target_identity
from ..models.loaded import LoadedModel, resolve_dtype
from .data import HELD_OUT, DataStats
from .features import FeatureCache, batch_tensors
from .loop import Progress, open_checkpoint, training_loop
from .samples import check_limits, choose_draft_vocab, data_record, rank_by_target, read_samples

RANKS = 10  # held-out accuracy of each head's 1st..RANKS-th choice (what a token tree's paths are chosen from)


@dataclass(frozen=True)
class MedusaSettings:
    """What a Medusa training run does; recorded in the checkpoint and the saved heads' config. The data fields
    mean what they mean for ``training.train.TrainSettings`` (the same reader, held-out split and batching)."""

    data: str = "sharegpt"
    limit: int | None = None  # training sequences (after the held-out ones); None = all
    limit_tokens: int | None = None  # stop reading training sequences once they hold this many tokens
    skip: int = 0  # training samples left out after the held-out ones
    held_out: int = HELD_OUT
    max_length: int = 1024
    epochs: int = 1
    batch_tokens: int = 2048
    heads: int = 3  # K: head i guesses the token i+2 positions past the feature's
    head_decay: float = 0.8  # head i's loss weight decay**i
    lr: float = 1e-3
    warmup_steps: int = 20
    grad_clip: float = 1.0
    draft_vocab: int = 0  # most frequent training tokens the heads learn to draft; 0 = the whole vocabulary
    extract_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"
    checkpoint_every: int = 100
    seed: int = 0
    spec_bench: str | None = None

    def __post_init__(self) -> None:
        for name in ("held_out", "max_length", "epochs", "batch_tokens", "heads", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_limits(self)
        if self.max_length > self.batch_tokens:
            raise ValueError(f"max_length ({self.max_length}) must not exceed batch_tokens ({self.batch_tokens})")
        if self.max_length < self.heads + 2:
            raise ValueError(f"max_length must be at least heads + 2 = {self.heads + 2}, got {self.max_length}")
        if not (self.lr > 0 and self.grad_clip > 0 and 0 < self.head_decay <= 1):
            raise ValueError("lr and grad_clip must be > 0 and head_decay in (0, 1]")
        if self.draft_vocab < 0 or self.warmup_steps < 0:
            raise ValueError("draft_vocab and warmup_steps must be >= 0")
        resolve_dtype(self.extract_dtype)
        resolve_dtype(self.compute_dtype)


@dataclass
class MedusaResult:
    folder: Path
    steps: int
    tokens: int
    samples: int
    elapsed: float
    accuracy: list[float]  # held-out top-1 agreement of head i with the target's token at t+i+2
    by_vocab: dict[int, dict[str, Any]] = field(default_factory=dict)  # per drafting vocabulary size N
    data: dict[str, Any] = field(default_factory=dict)


def future_rows(positions: torch.Tensor, offset: int) -> torch.Tensor:
    """Rows t of a packed batch whose row t + ``offset`` belongs to the same sequence (``positions`` restart at 0
    where a sequence begins)."""
    n = positions.shape[0]
    if offset >= n:
        return torch.zeros(0, dtype=torch.int64)
    start = torch.arange(n) - positions
    same = start[offset:] == start[:-offset]
    return same.nonzero().squeeze(1)


def medusa_loss(
    heads: MedusaHeads, parts: TargetParts, batch: tuple[torch.Tensor, ...], settings: MedusaSettings
) -> tuple[torch.Tensor, list[float], torch.Tensor]:
    """(loss, per-head top-1 agreement with the target over the drafting vocabulary, the target's argmax ids at
    the batch's rows): head i at row t against the target's law at row t+i+1."""
    features, _, positions = batch
    with torch.no_grad():
        teacher = F.log_softmax(parts.logits(features), dim=-1)  # row r: the target's law of the token at r+1
    outputs = heads(features)
    loss = features.new_zeros(())
    accuracy = []
    for i in range(heads.num_heads):
        rows = future_rows(positions, i + 1)
        if rows.numel() == 0:
            accuracy.append(0.0)
            continue
        log_q = F.log_softmax(parts.logits(outputs[rows, i]), dim=-1)
        wanted = teacher[rows + i + 1]
        loss = loss + settings.head_decay**i * -(wanted.exp() * log_q).sum(-1).mean()
        accuracy.append(float((log_q.argmax(-1) == wanted.argmax(-1)).float().mean()))
    return loss, accuracy, parts.to_vocab(teacher.argmax(-1))


@torch.no_grad()
def held_out_figures(
    heads: MedusaHeads,
    parts: TargetParts,
    full_rows: torch.Tensor,
    cache: FeatureCache,
    sequences: list[list[int]],
    sizes: list[int],
) -> dict[int, dict[str, Any]]:
    """Per drafting vocabulary size N (the first N ids of ``parts.draft_vocab``): for each head, how often its
    r-th choice (r = 1..RANKS) is the target's token (argmax over the whole vocabulary) i+2 positions past the
    feature read, and the share of the target's tokens among the N ids."""
    hits = {n: [[0] * RANKS for _ in range(heads.num_heads)] for n in sizes}
    counts = [0] * heads.num_heads
    inside = dict.fromkeys(sizes, 0)
    rank = torch.full((full_rows.shape[0],), full_rows.shape[0], dtype=torch.int64)
    rank[parts.draft_vocab] = torch.arange(parts.draft_vocab.numel())
    for s in range(len(sequences)):
        features, _, positions = batch_tensors(cache, "h", sequences, [s])
        normed = F.rms_norm(features, (parts.hidden_size,), parts.norm_weight, parts.eps)
        target_next = (normed @ full_rows.T).argmax(-1)  # row r: the target's token at r+1
        outputs = heads(features)
        for i in range(heads.num_heads):
            rows = future_rows(positions, i + 1)
            if rows.numel() == 0:
                continue
            wanted = target_next[rows + i + 1]
            logits = parts.logits(outputs[rows, i])
            counts[i] += rows.numel()
            for n in sizes:
                top = parts.to_vocab(logits[:, :n].topk(min(RANKS, n), dim=-1).indices)
                for r in range(top.shape[1]):
                    hits[n][i][r] += int((top[:, r] == wanted).sum())
                if i == 0:
                    inside[n] += int((rank[wanted] < n).sum())
    figures = {}
    for n in sizes:
        by_rank = [[round(h / max(c, 1), 4) for h in per_head] for per_head, c in zip(hits[n], counts, strict=True)]
        figures[n] = {
            "top1_by_head": [r[0] for r in by_rank],
            "rank_accuracy": by_rank,
            "coverage": round(inside[n] / max(counts[0], 1), 4),
        }
    return figures


def train_medusa(
    target: LoadedModel,
    settings: MedusaSettings,
    out: str | Path,
    resume: bool = False,
    on_step: Callable[[Progress], None] | None = None,
    on_start: Callable[[int, int, DataStats], None] | None = None,
    cache_bytes: int | None = None,
) -> MedusaResult:
    """Train Medusa heads for ``target`` and save them in ``out`` (see the module docstring). Features are cached
    in ``out/features``; ``out/checkpoint.pt`` is written every ``checkpoint_every`` steps and at each epoch's
    end; ``resume`` continues it and ends with the weights of an uninterrupted run. ``on_step`` gets a
    ``Progress`` (its ``accuracy``: head 0's top-1 on the step's batch). ``cache_bytes`` bounds the features cached
    on disk (``FeatureCache``; None: unbounded); it never changes the weights."""
    out = Path(out)
    checkpoint_path = out / "checkpoint.pt"

    def check_format(state: dict[str, Any]) -> None:
        if state.get("format") != FORMAT:
            raise ValueError(f"{checkpoint_path} is not a Medusa training checkpoint")

    state = open_checkpoint(checkpoint_path, settings, resume, check_format)
    if state is not None and state["target"] != target_identity(target):
        raise ValueError(f"{checkpoint_path} trains heads for {state['target']['name']!r}, not for this target")

    held_out, train, stats = read_samples(target, settings)
    draft_vocab = choose_draft_vocab(train, target.vocab_size, settings.draft_vocab)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    cache = FeatureCache(out / "features", target, resolve_dtype(settings.extract_dtype), cache_bytes)
    eps = float(text_config(target.model).rms_norm_eps)
    torch.manual_seed(settings.seed)
    heads = MedusaHeads(parts.hidden_size, settings.heads, eps)

    def loss_of(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, float, torch.Tensor]:
        loss, accuracy, target_ids = medusa_loss(heads, parts, batch, settings)
        return loss, accuracy[0], target_ids

    trained = training_loop(
        heads,
        settings,
        cache,
        train,
        loss_of,
        target.vocab_size,
        checkpoint_path,
        state,
        stats,
        key="heads",
        extra={"format": FORMAT, "target": target_identity(target)},
        on_step=on_step,
        on_start=on_start,
    )

    draft_vocab = rank_by_target(draft_vocab, trained.target_counts)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    sizes = [draft_vocab.numel(), *(n for n in (16384, 8192, 4096) if n < draft_vocab.numel())]
    full_rows = lm_head_rows(target.model)[: target.vocab_size]
    by_vocab = held_out_figures(heads, parts, full_rows, cache, held_out, sizes)
    top1 = by_vocab[sizes[0]]["top1_by_head"]
    cache.flush()
    elapsed = trained.elapsed()
    data = data_record(stats, train, held_out, cache, "sequences")
    training = {
        "settings": asdict(settings),
        "steps": trained.steps,
        "tokens_seen": trained.tokens,
        "wall_seconds": round(elapsed, 1),
        "held_out_top1_by_head": top1,
        "held_out_by_draft_vocab": {str(n): v for n, v in by_vocab.items()},
        "data": data,
        "torch": torch.__version__,
    }
    save_heads(out, heads, draft_vocab, target, training)
    return MedusaResult(out, trained.steps, trained.tokens, len(train), elapsed, top1, by_vocab, data)
