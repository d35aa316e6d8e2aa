"""Training an EAGLE head on a frozen target: teacher forcing over chats, distillation of the target's outputs.

For each training sequence the frozen target gives its features f_t (last layer, before the final norm); the
head, unrolled ``passes`` guesses deep as it drafts (``model.unrolled``), learns
``feature_weight · smoothL1(ŷ_{t+1}, f_{t+1} / s) + ce_weight · CE(target's next-token law, head's)`` (ŷ the
head's output, s the features' RMS on the held-out samples), both laws
over the head's drafting vocabulary, pass j weighted ``pass_decay**j``. The targets are the target model's
outputs, not the dataset's text.

Features are computed once per sequence and cached (bfloat16 shards in ``out/features``); a checkpoint
(``out/checkpoint.pt``) is written every ``checkpoint_every`` steps and at each epoch's end, so a run can be
resumed. A seed, the same batches, the cached features and the same torch thread count (recorded in the
checkpoint; a resume with another count is refused) make a run reproducible on the CPU: a resumed run ends with
the same weights as an uninterrupted one. ``device`` runs the extraction and the training on an accelerator
(``cuda``); the features are still cached on disk, and GPU kernels make no such bitwise promise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..heads.model import EagleHead, HeadShape, TargetParts, lm_head_rows, unrolled
from ..heads.saved import save_head
from ..models.loaded import LoadedModel, resolve_dtype
from .answer_rows import AnswerMarkers, answer_markers, answer_rows
from .calibrate import calibration_record, temperature_overlaps
from .data import HELD_OUT, DataStats
from .features import FeatureCache, batch_tensors, extract_batch_tokens, feature_scale
from .loop import Progress, Trained, open_checkpoint, training_device, training_loop
from .samples import (
    check_limits,
    choose_draft_vocab,
    data_record,
    rank_by_target,
    read_samples,
)

EVAL_DEPTHS = 5
LOSS_ROWS = ("all", "answers")  # every row of a sequence, or only those that guess an answer token


@dataclass(frozen=True)
class TrainSettings:
    """What a training run does; recorded in the checkpoint and the saved head's config."""

    data: str = "sharegpt"
    limit: int | None = None  # training samples (after the held-out ones); None = all
    limit_tokens: int | None = None  # stop reading training sequences once they hold this many tokens; None = all
    held_out: int = HELD_OUT  # the first samples of the data, never trained on: the accuracy figures (at least 1)
    skip: int = 0  # training samples left out after the held-out ones (e.g. those an init_from head saw)
    max_length: int = 1024  # tokens per training sequence (a longer sample gives several: windows.py)
    epochs: int = 1
    batch_tokens: int = 2048  # samples are packed into batches of at most this many tokens
    passes: int = 2  # guesses deep the head is unrolled in training
    pass_decay: float = 0.8
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    loss_rows: str = "all"  # "answers": the loss reads only rows that guess an assistant's token (answer_rows)
    lr: float = 1e-3
    warmup_steps: int = 20
    grad_clip: float = 1.0
    draft_vocab: int = 0  # most frequent training tokens the head learns to draft; 0 = the whole vocabulary
    init_from_target: bool = True  # start the decoder layer from the target's last layer
    init_from: str | None = None  # start from this saved head ("shipped": the target's shipped one) instead
    extract_dtype: str = "bfloat16"  # the target's dtype while computing features
    compute_dtype: str = "bfloat16"  # the head's matrix products in training (autocast; weights stay float32)
    checkpoint_every: int = 100
    seed: int = 0
    spec_bench: str | None = None  # Spec-Bench question.jsonl to exclude (default: the project's copy if present)

    def __post_init__(self) -> None:
        positive = ("held_out", "max_length", "epochs", "batch_tokens", "passes", "checkpoint_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_limits(self)
        if self.max_length > self.batch_tokens:
            raise ValueError(f"max_length ({self.max_length}) must not exceed batch_tokens ({self.batch_tokens})")
        if self.max_length < 4:
            raise ValueError(f"max_length must be at least 4, got {self.max_length}")
        if not (self.lr > 0 and self.grad_clip > 0 and 0 < self.pass_decay <= 1):
            raise ValueError("lr and grad_clip must be > 0 and pass_decay in (0, 1]")
        if self.feature_weight < 0 or self.ce_weight < 0 or self.feature_weight + self.ce_weight == 0:
            raise ValueError("feature_weight and ce_weight must be >= 0, not both 0")
        if self.loss_rows not in LOSS_ROWS:
            raise ValueError(f"loss_rows must be one of {', '.join(LOSS_ROWS)}, got {self.loss_rows!r}")
        if self.draft_vocab < 0 or self.warmup_steps < 0:
            raise ValueError("draft_vocab and warmup_steps must be >= 0")
        if self.init_from is not None and self.draft_vocab:
            raise ValueError("a head trained from a saved head drafts from that head's vocabulary: drop draft_vocab")
        resolve_dtype(self.extract_dtype)
        resolve_dtype(self.compute_dtype)


@dataclass
class TrainResult:
    folder: Path
    steps: int
    tokens: int
    samples: int
    elapsed: float
    accuracy: list[float]  # held-out top-1 agreement with the target at depths 1..EVAL_DEPTHS
    coverage: float  # held-out share of the target's argmax tokens inside the drafting vocabulary
    by_vocab: dict[int, dict[str, Any]] = field(default_factory=dict)  # the same, drafting from the top N ids
    data: dict[str, Any] = field(default_factory=dict)
    sampling_calibration: dict[str, Any] = field(default_factory=dict)  # heads.calibrate.calibration_record


def packed_answer_rows(tokens: torch.Tensor, positions: torch.Tensor, markers: AnswerMarkers | None) -> torch.Tensor:
    """``answer_rows`` of each sequence packed in ``tokens`` (a sequence begins where its position is 0)."""
    starts = (positions == 0).nonzero().squeeze(1).tolist() + [int(tokens.shape[0])]
    ids = tokens.tolist()
    rows = [answer_rows(ids[a:b], markers) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return torch.cat(rows).to(tokens.device) if rows else torch.zeros(0, dtype=torch.bool, device=tokens.device)


def head_loss(
    head: EagleHead,
    parts: TargetParts,
    batch: tuple[torch.Tensor, ...],
    settings: TrainSettings,
    scale: float,
    inputs: torch.Tensor | None = None,
    markers: AnswerMarkers | None = None,
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(training loss, depth-1 top-1 agreement with the target over the drafting vocabulary, the target's argmax
    ids at the rows trained on). The feature loss compares the head's output with the target's next features
    divided by ``scale``, their typical per-dimension size (the head predicts in those units), so that it weighs
    the same whatever the target's feature magnitudes. ``inputs``: what the head's first pass reads in place of
    the features (an experiment's other input, e.g. fused layers); the targets stay the features. With
    ``settings.loss_rows == "answers"`` only the rows that guess an answer token (``answer_rows`` under the
    template's ``markers``) count; every row still feeds the attention of the rows after it."""
    features, tokens, positions = batch
    counted = packed_answer_rows(tokens, positions, markers) if settings.loss_rows == "answers" else None
    next_features = torch.cat([features[1:], features[:1]])
    with torch.no_grad():
        target_log_probs = F.log_softmax(parts.logits(next_features), dim=-1)
    loss = features.new_zeros(())
    accuracy = 0.0
    target_ids = torch.zeros(0, dtype=torch.int64)
    passes = unrolled(head, parts, features if inputs is None else inputs, tokens, positions, settings.passes)
    for j, (predicted, valid) in enumerate(passes):
        rows = (valid if counted is None else valid & counted).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        feature_loss = F.smooth_l1_loss(predicted[rows], next_features[rows] / scale)
        log_probs = F.log_softmax(parts.logits(predicted[rows]), dim=-1)
        teacher = target_log_probs[rows]
        ce = -(teacher.exp() * log_probs).sum(-1).mean()
        loss = loss + settings.pass_decay**j * (settings.feature_weight * feature_loss + settings.ce_weight * ce)
        if j == 0:
            accuracy = float((log_probs.argmax(-1) == teacher.argmax(-1)).float().mean())
            target_ids = parts.to_vocab(teacher.argmax(-1))
    if not loss.requires_grad:  # no row counted (a batch of prompts cut before their answers): a zero step
        loss = loss + 0.0 * sum(predicted.sum() for predicted, _ in passes)
    return loss, accuracy, target_ids


@torch.no_grad()
def held_out_accuracy(
    head: EagleHead,
    parts: TargetParts,
    full_rows: torch.Tensor,
    cache: FeatureCache,
    sequences: list[list[int]],
    sizes: list[int],
    markers: AnswerMarkers | None = None,
) -> dict[int, dict[str, Any]]:
    """Per drafting vocabulary size N (the first N ids of ``parts.draft_vocab``): top-1 agreement with the
    target at depths 1..EVAL_DEPTHS over every row (``top1_by_depth``) and over the answer rows alone
    (``answers_top1_by_depth``: the rows drafting meets, ``answer_rows``), and the share of the target's tokens
    among those N ids. At depth d the head has read true features up to t-d+1 and its own guesses' features
    after, with the text's tokens; the reference is the target's argmax over its whole vocabulary."""
    hits = {n: [0] * EVAL_DEPTHS for n in sizes}
    answer_hits = {n: [0] * EVAL_DEPTHS for n in sizes}
    inside = dict.fromkeys(sizes, 0)
    counts = [0] * EVAL_DEPTHS
    answer_counts = [0] * EVAL_DEPTHS
    device = full_rows.device
    rank = torch.full((full_rows.shape[0],), full_rows.shape[0], dtype=torch.int64, device=device)
    rank[parts.draft_vocab] = torch.arange(parts.draft_vocab.numel(), device=device)
    for i in range(len(sequences)):
        features, tokens, positions = (t.to(device) for t in batch_tensors(cache, "h", sequences, [i]))
        answers = answer_rows(sequences[i], markers).to(device)
        normed = F.rms_norm(features, (parts.hidden_size,), parts.norm_weight, parts.eps)
        # row t guesses the token after t+1: the target's argmax at row t+1
        target_next = (normed @ full_rows.T).argmax(-1).roll(-1)
        for j, (predicted, valid) in enumerate(unrolled(head, parts, features, tokens, positions, EVAL_DEPTHS)):
            logits = parts.logits(predicted[valid])
            wanted = target_next[valid]
            counted = answers[valid]
            counts[j] += int(valid.sum())
            answer_counts[j] += int(counted.sum())
            for n in sizes:
                agree = parts.to_vocab(logits[:, :n].argmax(-1)) == wanted
                hits[n][j] += int(agree.sum())
                answer_hits[n][j] += int((agree & counted).sum())
                if j == 0:
                    inside[n] += int((rank[wanted] < n).sum())
    return {
        n: {
            "top1_by_depth": [round(h / max(c, 1), 4) for h, c in zip(hits[n], counts, strict=True)],
            "answers_top1_by_depth": [
                round(h / max(c, 1), 4) for h, c in zip(answer_hits[n], answer_counts, strict=True)
            ],
            "coverage": round(inside[n] / max(counts[0], 1), 4),
        }
        for n in sizes
    }


def initial_head(target: LoadedModel, source: str) -> tuple[EagleHead, torch.Tensor, float]:
    """(head to train, its drafting vocabulary, its feature scale) from a saved head (``shipped``: the one
    shipped for ``target``), checked against ``target``."""
    from ..heads.saved import load_head, shipped_head

    folder = shipped_head(target) if source == "shipped" else Path(source)
    head, draft_vocab, config = load_head(folder, target)
    scale = config.get("training", {}).get("feature_scale")
    if scale is None:
        raise ValueError(f"the head in {folder} does not record its feature scale: it cannot be trained further")
    return head.train().requires_grad_(True), draft_vocab, float(scale)


def train_head(
    target: LoadedModel,
    settings: TrainSettings,
    out: str | Path,
    resume: bool = False,
    on_step: Callable[[Progress], None] | None = None,
    on_start: Callable[[int, int, DataStats], None] | None = None,
    device: str = "cpu",
    cache_bytes: int | None = None,
    max_seconds: float | None = None,
) -> TrainResult:
    """Train a head for ``target`` and save it in ``out`` (see the module docstring). ``on_start`` receives
    (total steps, steps already done, reader stats) once the data is read. ``device`` other than the CPU moves
    the target's model there (it stays there) and trains there. ``cache_bytes`` bounds the features cached on disk
    (``FeatureCache``; None: unbounded); it never changes the weights. ``max_seconds`` stops the training steps
    after that long (``training_loop``); the head is evaluated and saved as it then stands."""
    out = Path(out)
    checkpoint_path = out / "checkpoint.pt"
    device = training_device(device)
    state = open_checkpoint(checkpoint_path, settings, resume)
    target.model.to(device)

    held_out, train, stats = read_samples(target, settings)
    cache = FeatureCache(
        out / "features", target, resolve_dtype(settings.extract_dtype), cache_bytes, extract_batch_tokens(device)
    )
    torch.manual_seed(settings.seed)
    head, draft_vocab, scale = _starting_head(target, settings, cache, train, held_out)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    markers = answer_markers(target)
    head.to(device)
    trained = training_loop(
        head,
        settings,
        cache,
        train,
        lambda batch: head_loss(head, parts, batch, settings, scale, markers=markers),
        target.vocab_size,
        checkpoint_path,
        state,
        stats,
        on_step=on_step,
        on_start=on_start,
        device=device,
        max_seconds=max_seconds,
    )

    draft_vocab = rank_by_target(draft_vocab, trained.target_counts)
    by_vocab, calibration = _evaluated(head, target, draft_vocab, cache, held_out, markers)
    first = by_vocab[draft_vocab.numel()]
    cache.flush()
    elapsed = trained.elapsed()
    data = data_record(stats, train, held_out, cache, "samples")
    training = _training_record(settings, scale, trained, elapsed, by_vocab, first, data)
    save_head(out, head, draft_vocab, target, training, calibration)
    return TrainResult(
        out, trained.steps, trained.tokens, len(train), elapsed, first["top1_by_depth"], first["coverage"], by_vocab,
        data, calibration
    )  # fmt: skip


def _starting_head(
    target: LoadedModel,
    settings: TrainSettings,
    cache: FeatureCache,
    train: list[list[int]],
    held_out: list[list[int]],
) -> tuple[EagleHead, torch.Tensor, float]:
    """(head, its drafting vocabulary, its feature scale) a run starts from: a saved head's (fine-tuning: its
    weights, vocabulary and feature units), or a new head drafting the most frequent training tokens, its decoder
    layer the target's last unless ``init_from_target`` is off."""
    if settings.init_from is not None:
        return initial_head(target, settings.init_from)
    draft_vocab = choose_draft_vocab(train, target.vocab_size, settings.draft_vocab)
    scale = feature_scale(cache, held_out)
    head = EagleHead(HeadShape.of(target.model))
    if settings.init_from_target:
        head.layer.load_target_layer(target.model.get_decoder().layers[-1], scale, target.model)
    return head, draft_vocab, scale


def _evaluated(
    head: EagleHead,
    target: LoadedModel,
    draft_vocab: torch.Tensor,
    cache: FeatureCache,
    held_out: list[list[int]],
    markers: AnswerMarkers | None,
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """(``held_out_accuracy`` drafting from the whole ``draft_vocab`` and from its first 32768 / 16384 / 8192 ids,
    the head's sampling calibration over the held-out chats)."""
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    sizes = [draft_vocab.numel(), *(n for n in (32768, 16384, 8192) if n < draft_vocab.numel())]
    full_rows = lm_head_rows(target.model)[: target.vocab_size]
    by_vocab = held_out_accuracy(head, parts, full_rows, cache, held_out, sizes, markers)
    held = (batch_tensors(cache, "h", held_out, [i]) for i in range(len(held_out)))
    calibration = calibration_record(temperature_overlaps(head, parts, full_rows, held))
    calibration["contexts"] = "the held-out chats"
    return by_vocab, calibration


def _training_record(
    settings: TrainSettings,
    scale: float,
    trained: Trained,
    elapsed: float,
    by_vocab: dict[int, dict[str, Any]],
    first: dict[str, Any],
    data: dict[str, Any],
) -> dict[str, Any]:
    """The ``training`` entry of the saved head's config: the settings, the run, and the held-out figures (``first``:
    those drafting from the whole vocabulary)."""
    return {
        "settings": asdict(settings),
        "feature_scale": round(scale, 4),
        "steps": trained.steps,
        "planned_steps": trained.planned_steps,
        "tokens_seen": trained.tokens,
        "wall_seconds": round(elapsed, 1),
        "held_out_top1_by_depth": first["top1_by_depth"],
        "held_out_answers_top1_by_depth": first["answers_top1_by_depth"],
        "held_out_draft_vocab_coverage": first["coverage"],
        "held_out_by_draft_vocab": {str(n): v for n, v in by_vocab.items()},
        "data": data,
        "torch": torch.__version__,
    }
