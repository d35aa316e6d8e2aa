"""The training loop that EAGLE's ``train_head`` and Medusa's ``train_medusa`` share: batches packed from the
sequences (a seed per epoch), AdamW under a warm-up then cosine schedule, checkpoints a resumed run continues bit
for bit (the same settings and torch thread count), and the device it runs on."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..models.loaded import resolve_dtype
from .data import DataStats
from .features import FeatureCache, batch_tensors


class Schedule(Protocol):
    """What the loop reads of a run's settings (a frozen dataclass: ``train.TrainSettings``,
    ``medusa.MedusaSettings``), whose fields a checkpoint records."""

    seed: int
    epochs: int
    batch_tokens: int
    lr: float
    warmup_steps: int
    grad_clip: float
    compute_dtype: str
    checkpoint_every: int


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


def epoch_batches(lengths: list[int], settings: Schedule, epoch: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(settings.seed * 7919 + epoch)
    return pack(lengths, torch.randperm(len(lengths), generator=generator).tolist(), settings.batch_tokens)


def learning_rate(settings: Schedule, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, total - settings.warmup_steps)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


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


def open_checkpoint(
    path: Path,
    settings: Schedule,
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
    settings: Schedule,
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
    run = _Run(torch.zeros(vocab_size, dtype=torch.int64))
    if state is not None:
        run = _Run.resumed(state, model, optimizer, key)
    if on_start is not None:
        on_start(total_steps, run.step, stats)
    run.started = time.perf_counter()

    def checkpoint(next_epoch: int, next_batch: int) -> None:
        cache.flush()
        saved = {**(extra or {}), key: model.state_dict(), "optimizer": optimizer.state_dict()}
        _save_checkpoint(checkpoint_path, saved, run, next_epoch, next_batch, settings)

    autocast = resolve_dtype(settings.compute_dtype) == torch.bfloat16
    model.train()
    for epoch, b, batches in _remaining(schedule, run.epoch, run.batch):
        run.epoch = epoch
        batch = tuple(t.to(device) for t in batch_tensors(cache, "t", sequences, batches[b]))
        lr = learning_rate(settings, run.step, total_steps)
        loss, accuracy, target_ids = _step(model, optimizer, loss_of, batch, lr, settings.grad_clip, device, autocast)
        run.target_counts += torch.bincount(target_ids.cpu(), minlength=vocab_size)
        run.step += 1
        run.tokens += int(batch[1].shape[0])
        last = b + 1 == len(batches)
        save = last or run.step % settings.checkpoint_every == 0
        if save:
            checkpoint(run.epoch + 1 if last else run.epoch, 0 if last else b + 1)
        out_of_time = max_seconds is not None and time.perf_counter() - run.started >= max_seconds
        if out_of_time and not save:
            checkpoint(run.epoch, b + 1)
        if on_step is not None:
            progress = (run.step, total_steps, run.epoch, run.tokens, loss.item(), accuracy, run.elapsed())
            on_step(Progress(*progress, save or out_of_time))
        if out_of_time:
            break
    model.eval()
    return Trained(run.step, run.tokens, run.target_counts, run.elapsed_before, run.started, total_steps)


def _remaining(schedule: list[list[list[int]]], epoch: int, batch: int) -> Iterator[tuple[int, int, list[list[int]]]]:
    """(epoch, batch index, that epoch's batches) of each step left in ``schedule``, from ``batch`` of ``epoch``."""
    for e in range(epoch, len(schedule)):
        for b in range(batch if e == epoch else 0, len(schedule[e])):
            yield e, b, schedule[e]


@dataclass
class _Run:
    """Where a ``training_loop`` stands."""

    target_counts: torch.Tensor  # how often each id was the target's argmax in training
    epoch: int = 0  # the epoch of the step under way (or, resumed, the next one)
    batch: int = 0  # the batch a resumed run starts at, in ``epoch``
    step: int = 0  # steps done
    tokens: int = 0  # training tokens processed (all epochs)
    elapsed_before: float = 0.0  # seconds of the earlier runs of a resumed training
    started: float = 0.0  # time.perf_counter() when this run's loop began

    @classmethod
    def resumed(cls, state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, key: str) -> _Run:
        """The run a checkpoint's ``state`` left, its weights and optimizer state loaded (``model``, ``optimizer``)."""
        model.load_state_dict(state[key])
        optimizer.load_state_dict(state["optimizer"])
        where = (state["epoch"], state["batch"], state["step"], state["tokens"], state["elapsed"])
        return cls(state["target_counts"], *where)

    def elapsed(self) -> float:
        """Seconds of training so far, earlier runs included."""
        return self.elapsed_before + time.perf_counter() - self.started


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_of: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, float, torch.Tensor]],
    batch: tuple[torch.Tensor, ...],
    lr: float,
    grad_clip: float,
    device: torch.device,
    autocast: bool,
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """One AdamW step at learning rate ``lr`` on ``batch`` (gradients clipped to ``grad_clip``): ``loss_of(batch)``,
    computed under bfloat16 autocast when ``autocast``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, accuracy, target_ids = loss_of(batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss, accuracy, target_ids


def _save_checkpoint(
    path: Path,
    saved: dict[str, Any],
    run: _Run,
    next_epoch: int,
    next_batch: int,
    settings: Schedule,
) -> None:
    """Write ``saved`` (the weights and optimizer state) and where ``run`` stands to ``path`` (staged, then renamed:
    never half-written); ``next_epoch`` and ``next_batch`` say where a resumed run starts."""
    staging = path.with_suffix(".tmp")
    where = {"epoch": next_epoch, "batch": next_batch, "step": run.step, "tokens": run.tokens, "elapsed": run.elapsed()}
    torch.save(
        {
            **saved,
            **where,
            "settings": asdict(settings),
            "target_counts": run.target_counts,
            "threads": torch.get_num_threads(),
        },
        staging,
    )
    os.replace(staging, path)
