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

import copy
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..heads.model import EagleHead, HeadShape, TargetParts, lm_head_rows, unrolled
from ..heads.saved import save_head
from ..models.loader import LoadedModel, resolve_dtype
from . import windows
from .answer_rows import AnswerMarkers, answer_markers, answer_rows
from .calibrate import calibration_record, temperature_overlaps
from .data import HELD_OUT, DataStats, Sample, iter_samples, spec_bench_questions

if TYPE_CHECKING:
    from .medusa import MedusaSettings

EVAL_DEPTHS = 5
LOSS_ROWS = ("all", "answers")  # every row of a sequence, or only those that guess an answer token
EXTRACT_BATCH_TOKENS = 1 << 15  # padded tokens a feature forward takes off the CPU (one sequence a forward on it)


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


def check_limits(settings: TrainSettings | MedusaSettings) -> None:
    """``limit`` and ``limit_tokens`` are positive integers or None; ``skip`` an integer >= 0."""
    for name in ("limit", "limit_tokens"):
        value = getattr(settings, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if isinstance(settings.skip, bool) or not isinstance(settings.skip, int) or settings.skip < 0:
        raise ValueError(f"skip must be an integer >= 0, got {settings.skip!r}")


@dataclass
class Progress:
    """Where a run stands, passed to ``on_step`` after every step (and after any checkpoint it wrote)."""

    step: int
    total_steps: int
    epoch: int
    tokens: int  # training tokens processed so far (all epochs)
    loss: float
    accuracy: float  # this step's depth-1 top-1 agreement with the target (drafting vocabulary)
    elapsed: float  # seconds, including earlier runs of a resumed training
    checkpointed: bool


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


def tokenize(target: LoadedModel, sample: Sample, max_length: int) -> list[int]:
    """Token ids of a chat (the target's chat template, or the turns' text joined by newlines without one) or a
    text: the first of its ``token_windows``."""
    return token_windows(target, sample, max_length)[0]


def token_windows(target: LoadedModel, sample: Sample, max_length: int) -> list[list[int]]:
    """A text's ids in consecutive windows of ``max_length`` tokens, a chat's in windows of whole exchanges
    (``windows.token_windows``): a long document or a long chat trains as many samples, not one cut short."""
    return windows.token_windows(target.tokenizer, sample, max_length)


def read_samples(
    target: LoadedModel, settings: TrainSettings | MedusaSettings
) -> tuple[list[list[int]], list[list[int]], DataStats]:
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


def pack(lengths: list[int], order: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive samples of ``order`` grouped into batches of at most ``batch_tokens`` tokens."""
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + lengths[i] > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        batches.append(current)
    return batches


def epoch_batches(lengths: list[int], settings: TrainSettings, epoch: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(settings.seed * 7919 + epoch)
    return pack(lengths, torch.randperm(len(lengths), generator=generator).tolist(), settings.batch_tokens)


class FeatureCache:
    """The target's features per sequence (bfloat16), computed on first use and kept in shards on disk.

    Shards are memory-mapped and read a sequence at a time, so the memory a run holds is bounded by the features
    computed since the last flush (a checkpoint), not by the data: the operating system pages the rest. The disk
    is bounded by ``max_bytes`` (None: unbounded; plus one shard's header): once the shards would pass it, further
    features are computed each time they are needed and not kept. Either way a feature is its bfloat16 rounding,
    so a capped run trains exactly as an uncapped one. ``batch_tokens`` > 0 computes a batch's missing features
    in right-padded forwards of at most that many tokens (causal attention: a row never sees the padding after
    it), what keeps a GPU busy; 0 computes one sequence a forward (the CPU's default: no padding computed).
    """

    def __init__(
        self,
        folder: Path,
        target: LoadedModel,
        dtype: torch.dtype,
        max_bytes: int | None = None,
        batch_tokens: int = 0,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"the feature cache's size must be >= 0 bytes, got {max_bytes}")
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._target = target
        self._dtype = dtype
        self._max_bytes = max_bytes
        self._batch_tokens = batch_tokens
        self._extractor: torch.nn.Module | None = None
        self._shards: list[Any] = []  # open safetensors files (memory-mapped)
        self._where: dict[str, Any] = {}  # key -> the shard holding it (a later shard wins)
        self._pending: dict[str, torch.Tensor] = {}
        self.stored_bytes = 0  # the shards' sizes plus the features waiting for the next flush
        self.uncached: set[str] = set()  # keys computed but not kept: the cap was reached
        for shard in sorted(self.folder.glob("shard-*.safetensors")):
            self._open(shard)

    def _open(self, shard: Path) -> None:
        self.stored_bytes += shard.stat().st_size
        handle = safe_open(str(shard), framework="pt")
        self._shards.append(handle)
        self._where.update(dict.fromkeys(handle.keys(), handle))

    def get_many(self, keys: list[str], id_lists: list[list[int]]) -> list[torch.Tensor]:
        """``get`` for each (key, ids), the missing features computed ``batch_tokens`` at a time."""
        computed: dict[str, torch.Tensor] = {}
        if self._batch_tokens > 0:
            missing = [j for j, key in enumerate(keys) if self._stored(key, len(id_lists[j])) is None]
            group: list[int] = []
            for j in [*missing, None]:
                longest = max([len(id_lists[i]) for i in group] + [0 if j is None else len(id_lists[j])])
                if group and (j is None or (len(group) + 1) * longest > self._batch_tokens):
                    rows = self._extract_padded([id_lists[i] for i in group])
                    computed.update((keys[i], row) for i, row in zip(group, rows, strict=True))
                    group = []
                if j is not None:
                    group.append(j)
        return [self.get(key, ids, computed.get(key)) for key, ids in zip(keys, id_lists, strict=True)]

    def get(self, key: str, ids: list[int], computed: torch.Tensor | None = None) -> torch.Tensor:
        """Features [len(ids), H] in float32 (from their bfloat16 copy, so cached and fresh runs agree);
        ``computed``: the sequence's features computed elsewhere, used when none are stored."""
        found = self._stored(key, len(ids))
        if found is None:
            found = (self._extract(ids) if computed is None else computed).to(torch.bfloat16).contiguous()
            size = found.numel() * found.element_size()
            if self._max_bytes is None or self.stored_bytes + size <= self._max_bytes:
                self._pending[key] = found
                self.stored_bytes += size
            else:
                self.uncached.add(key)
        return found.float()

    def _stored(self, key: str, length: int) -> torch.Tensor | None:
        found = self._pending.get(key)
        if found is None and key in self._where:
            found = self._where[key].get_tensor(key)
        return found if found is not None and found.shape[0] == length else None

    def flush(self) -> None:
        """Write the features computed since the last flush as a new shard."""
        if not self._pending:
            return
        index = len(list(self.folder.glob("shard-*.safetensors")))
        final = self.folder / f"shard-{index:05d}.safetensors"
        staging = final.with_suffix(".tmp")
        save_file(self._pending, str(staging))
        os.replace(staging, final)
        self.stored_bytes -= sum(t.numel() * t.element_size() for t in self._pending.values())
        self._pending = {}
        self._open(final)  # counts the shard as written (its header included)

    @torch.inference_mode()
    def _extract(self, ids: list[int]) -> torch.Tensor:
        """Features [len(ids), H] on the CPU, computed wherever the target's weights are."""
        model = self._model()
        device = next(model.parameters()).device
        captured: list[torch.Tensor] = []
        hook = model.get_decoder().norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            model.get_decoder()(input_ids=torch.tensor([ids], device=device), use_cache=False)
        finally:
            hook.remove()
        return captured[0][0].float().cpu()

    @torch.inference_mode()
    def _extract_padded(self, id_lists: list[list[int]]) -> list[torch.Tensor]:
        """``_extract`` of each sequence, all in one forward: right-padded with id 0, each row's real positions
        cut out of the result (a causal model's row t reads positions ≤ t only)."""
        model = self._model()
        device = next(model.parameters()).device
        width = max(len(ids) for ids in id_lists)
        padded = torch.zeros((len(id_lists), width), dtype=torch.int64)
        for row, ids in enumerate(id_lists):
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        captured: list[torch.Tensor] = []
        hook = model.get_decoder().norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
        try:
            model.get_decoder()(input_ids=padded.to(device), use_cache=False)
        finally:
            hook.remove()
        features = captured[0].float().cpu()
        return [features[row, : len(ids)] for row, ids in enumerate(id_lists)]

    def _model(self) -> torch.nn.Module:
        if self._extractor is None:
            model = self._target.model
            dtype = next(model.parameters()).dtype
            self._extractor = model if dtype == self._dtype else copy.deepcopy(model).to(self._dtype)
        return self._extractor


def batch_tensors(
    cache: FeatureCache, prefix: str, sequences: list[list[int]], indices: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed (features [T, H], tokens [T], positions [T]) of the sequences ``indices``."""
    features = torch.cat(cache.get_many([f"{prefix}{i}" for i in indices], [sequences[i] for i in indices]))
    tokens = torch.tensor([t for i in indices for t in sequences[i]], dtype=torch.int64)
    positions = torch.cat([torch.arange(len(sequences[i])) for i in indices])
    return features, tokens, positions


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


def feature_scale(cache: FeatureCache, sequences: list[list[int]]) -> float:
    """Root mean square of the target's features over ``sequences`` (their first position excluded: it often
    carries a few outsized activations)."""
    squares = [cache.get(f"h{i}", ids)[1:].square().mean() for i, ids in enumerate(sequences)]
    return float(torch.stack(squares).mean().sqrt())


def learning_rate(settings: TrainSettings, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, total - settings.warmup_steps)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# --- the training loop (train_head's and training.medusa.train_medusa's) -----------------------------------------


def training_device(name: str) -> torch.device:
    """The torch device called ``name`` (cpu, cuda, cuda:1, ...), refused in one line when this machine has none."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"unknown device {name!r} (cpu, cuda, cuda:N): {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device (use --device cpu)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return device


def extract_batch_tokens(device: torch.device) -> int:
    """``FeatureCache``'s batch for features computed on ``device``: one sequence a forward on the CPU."""
    return 0 if device.type == "cpu" else EXTRACT_BATCH_TOKENS


def open_checkpoint(
    path: Path,
    settings: TrainSettings | MedusaSettings,
    resume: bool,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any] | None:
    """The checkpoint at ``path`` to resume (vetted by ``check``, then for the same settings and torch thread
    count, without which the resumed run would not end with an uninterrupted run's weights), or None for a fresh
    run, which a checkpoint already there refuses; makes ``path``'s folder. A setting the checkpoint predates
    counts as its default."""
    state = None
    if resume:
        if not path.is_file():
            raise FileNotFoundError(f"nothing to resume: {path} does not exist")
        state = torch.load(path, weights_only=False, map_location="cpu")
        if check is not None:
            check(state)
        defaults = asdict(type(settings)())
        changed = sorted(k for k, v in asdict(settings).items() if state["settings"].get(k, defaults[k]) != v)
        if changed:
            raise ValueError(f"--resume needs the settings of the interrupted run; these differ: {', '.join(changed)}")
        threads = state.get("threads", 1)  # checkpoints before the thread count was recorded ran on one
        if threads != torch.get_num_threads():
            raise ValueError(
                f"--resume needs the thread count of the interrupted run: it ran on {threads} torch threads, this "
                f"run has {torch.get_num_threads()} (pass --threads {threads})"
            )
    elif path.exists():
        raise ValueError(
            f"{path.parent} holds a training checkpoint: pass --resume to continue it, or choose another --out"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    return state


@dataclass(frozen=True)
class Trained:
    """Where a finished ``training_loop`` stands."""

    steps: int
    tokens: int  # training tokens processed (all epochs)
    target_counts: torch.Tensor  # how often each id was the target's argmax in training
    elapsed_before: float  # seconds of the earlier runs of a resumed training
    started: float  # time.perf_counter() when this run's loop began
    planned_steps: int = 0  # the schedule's steps; more than ``steps`` when a time limit stopped the run

    def elapsed(self) -> float:
        """Seconds of training so far, earlier runs included."""
        return self.elapsed_before + time.perf_counter() - self.started


def training_loop(
    model: torch.nn.Module,
    settings: TrainSettings | MedusaSettings,
    cache: FeatureCache,
    sequences: list[list[int]],
    loss_of: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, float, torch.Tensor]],
    vocab_size: int,
    checkpoint_path: Path,
    state: dict[str, Any] | None,
    stats: DataStats,
    key: str = "head",
    extra: dict[str, Any] | None = None,
    on_step: Callable[[Progress], None] | None = None,
    on_start: Callable[[int, int, DataStats], None] | None = None,
    device: torch.device | str = "cpu",
    max_seconds: float | None = None,
) -> Trained:
    """Train ``model`` (on ``device``) on ``sequences`` (their cached features, packed by ``epoch_batches``): AdamW at
    ``learning_rate``, ``loss_of(batch)`` = (loss, the step's accuracy for ``Progress``, the target's argmax ids
    at the rows trained on) under autocast per ``compute_dtype``, gradients clipped to ``grad_clip``. The
    checkpoint (the ``extra`` entries, ``model``'s weights under ``key``, the optimizer's state, where the run
    stands, the torch thread count) is written every ``checkpoint_every`` steps and at each epoch's end;
    ``state``, one read back, continues the run bit for bit. ``on_start`` gets (total steps, steps already done,
    ``stats``). ``max_seconds`` ends this run after the first step that reaches it (checkpointed, so a resume
    continues the same schedule); the learning-rate schedule is the whole run's either way."""
    device = torch.device(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    lengths = [len(s) for s in sequences]
    schedule = [epoch_batches(lengths, settings, e) for e in range(settings.epochs)]
    total_steps = sum(len(b) for b in schedule)
    epoch, done_in_epoch, step, tokens, elapsed_before = 0, 0, 0, 0, 0.0
    target_counts = torch.zeros(vocab_size, dtype=torch.int64)
    if state is not None:
        model.load_state_dict(state[key])
        optimizer.load_state_dict(state["optimizer"])
        epoch, done_in_epoch, step = state["epoch"], state["batch"], state["step"]
        tokens, elapsed_before, target_counts = state["tokens"], state["elapsed"], state["target_counts"]
    if on_start is not None:
        on_start(total_steps, step, stats)
    started = time.perf_counter()

    def checkpoint(next_epoch: int, next_batch: int) -> None:
        cache.flush()
        staging = checkpoint_path.with_suffix(".tmp")
        torch.save(
            {
                **(extra or {}),
                key: model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": next_epoch,
                "batch": next_batch,
                "step": step,
                "tokens": tokens,
                "elapsed": elapsed_before + time.perf_counter() - started,
                "settings": asdict(settings),
                "target_counts": target_counts,
                "threads": torch.get_num_threads(),
            },
            staging,
        )
        os.replace(staging, checkpoint_path)

    autocast = resolve_dtype(settings.compute_dtype) == torch.bfloat16
    model.train()
    while epoch < settings.epochs:
        batches = schedule[epoch]
        for b in range(done_in_epoch, len(batches)):
            batch = tuple(t.to(device) for t in batch_tensors(cache, "t", sequences, batches[b]))
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(settings, step, total_steps)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss, accuracy, target_ids = loss_of(batch)
            target_counts += torch.bincount(target_ids.cpu(), minlength=vocab_size)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            step += 1
            tokens += int(batch[1].shape[0])
            last = b + 1 == len(batches)
            save = last or step % settings.checkpoint_every == 0
            if save:
                checkpoint(epoch + 1 if last else epoch, 0 if last else b + 1)
            out_of_time = max_seconds is not None and time.perf_counter() - started >= max_seconds
            if out_of_time and not save:
                checkpoint(epoch, b + 1)
            if on_step is not None:
                elapsed = elapsed_before + time.perf_counter() - started
                on_step(Progress(step, total_steps, epoch, tokens, loss.item(), accuracy, elapsed, save or out_of_time))
            if out_of_time:
                model.eval()
                return Trained(step, tokens, target_counts, elapsed_before, started, total_steps)
        epoch, done_in_epoch = epoch + 1, 0
    model.eval()
    return Trained(step, tokens, target_counts, elapsed_before, started, total_steps)


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
    if settings.init_from is not None:  # fine-tuning: its weights, drafting vocabulary and feature units
        head, draft_vocab, scale = initial_head(target, settings.init_from)
    else:
        draft_vocab = choose_draft_vocab(train, target.vocab_size, settings.draft_vocab)
        scale = feature_scale(cache, held_out)
        head = EagleHead(HeadShape.of(target.model))
        if settings.init_from_target:
            head.layer.load_target_layer(target.model.get_decoder().layers[-1], scale, target.model)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    markers = answer_markers(target.tokenizer)
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
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    sizes = [draft_vocab.numel(), *(n for n in (32768, 16384, 8192) if n < draft_vocab.numel())]
    full_rows = lm_head_rows(target.model)[: target.vocab_size]
    by_vocab = held_out_accuracy(head, parts, full_rows, cache, held_out, sizes, markers)
    accuracy, coverage = by_vocab[sizes[0]]["top1_by_depth"], by_vocab[sizes[0]]["coverage"]
    held = (batch_tensors(cache, "h", held_out, [i]) for i in range(len(held_out)))
    calibration = calibration_record(temperature_overlaps(head, parts, full_rows, held))
    calibration["contexts"] = "the held-out chats"
    cache.flush()
    elapsed = trained.elapsed()
    data = {
        "samples_read": stats.samples,
        "spec_bench_excluded": stats.excluded,
        "spec_bench_checked": stats.spec_bench_checked,
        "train_samples": len(train),
        "train_tokens_per_epoch": sum(len(s) for s in train),
        "held_out_samples": len(held_out),
        "held_out_tokens": sum(len(s) for s in held_out),
        "features_cached_bytes": cache.stored_bytes,
        "sequences_not_cached": len(cache.uncached),  # recomputed when needed: past cache_bytes
    }
    training = {
        "settings": asdict(settings),
        "feature_scale": round(scale, 4),
        "steps": trained.steps,
        "planned_steps": trained.planned_steps,
        "tokens_seen": trained.tokens,
        "wall_seconds": round(elapsed, 1),
        "held_out_top1_by_depth": accuracy,
        "held_out_answers_top1_by_depth": by_vocab[sizes[0]]["answers_top1_by_depth"],
        "held_out_draft_vocab_coverage": coverage,
        "held_out_by_draft_vocab": {str(n): v for n, v in by_vocab.items()},
        "data": data,
        "torch": torch.__version__,
    }
    save_head(out, head, draft_vocab, target, training, calibration)
    return TrainResult(
        out, trained.steps, trained.tokens, len(train), elapsed, accuracy, coverage, by_vocab, data, calibration
    )
