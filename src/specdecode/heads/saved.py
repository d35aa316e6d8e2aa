"""The saved head: ``head.safetensors`` (fc + the decoder layer, bfloat16; the drafting vocabulary's ids) and
``config.json`` (format, the target it was trained for, shapes, how it was trained)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..models.loaded import LoadedModel
from ..version import __version__
from .model import EagleHead, HeadShape, config_fingerprint, vocab_fingerprint

FORMAT = "specdecode-eagle-head"
VERSION = 2  # 2: the head normalises its two inputs (feature_norm, embed_norm)
SHIPPED = Path(__file__).parent / "shipped"


def target_identity(target: LoadedModel) -> dict[str, Any]:
    """The name and fingerprints a head records for the target it was trained for."""
    return {
        "name": target.name,
        "model_type": target.model.config.get_text_config().model_type,
        "config_fingerprint": config_fingerprint(target.model),
        "vocab_fingerprint": vocab_fingerprint(target.tokenizer),
        "vocab_size": target.vocab_size,
    }


def save_head(
    folder: str | Path,
    head: EagleHead,
    draft_vocab: torch.Tensor,
    target: LoadedModel,
    training: dict[str, Any] | None = None,
    sampling_calibration: dict[str, Any] | None = None,
) -> Path:
    """Write ``head.safetensors`` (bfloat16 weights) and ``config.json`` into ``folder``; return the folder.
    ``sampling_calibration``: the head's temperature factors (``heads.calibrate.calibration_record``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu", torch.bfloat16).contiguous() for name, p in head.state_dict().items()}
    tensors["draft_vocab"] = draft_vocab.to("cpu", torch.int64).contiguous()
    save_file(tensors, str(folder / "head.safetensors"), metadata={"format": FORMAT})
    config = {
        "format": FORMAT,
        "version": VERSION,
        "specdecode": __version__,
        "target": target_identity(target),
        "shape": asdict(head.shape),
        "draft_vocab_size": int(draft_vocab.numel()),
        "training": training or {},
    }
    if sampling_calibration is not None:
        config["sampling_calibration"] = sampling_calibration
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_config(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file() or not (folder / "head.safetensors").is_file():
        raise FileNotFoundError(f"{folder} is not a saved head (it needs config.json and head.safetensors)")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ValueError(f"{path} is not a {FORMAT} version {VERSION} config")
    return config


def check_target(config: dict[str, Any], target: LoadedModel, folder: str | Path, command: str = "train-head") -> None:
    """Raise ValueError unless the head in ``folder`` was trained for a target like ``target`` (the message names
    ``command``, which trains one)."""
    trained, given = config["target"], target_identity(target)
    same_config = trained["config_fingerprint"] == given["config_fingerprint"]
    vocabs = trained.get("vocab_fingerprint"), given["vocab_fingerprint"]
    same_vocab = None in vocabs or vocabs[0] == vocabs[1]
    if not (same_config and same_vocab):
        what = "config" if not same_config else "vocabulary"
        raise ValueError(
            f"the head in {folder} was trained for {trained['name']!r}, not for {target.name!r}: their {what} "
            f"fingerprints differ ({trained['config_fingerprint']}/{vocabs[0]} vs "
            f"{given['config_fingerprint']}/{vocabs[1]}); train one for this model with specdecode {command}"
        )


def load_head(folder: str | Path, target: LoadedModel) -> tuple[EagleHead, torch.Tensor, dict[str, Any]]:
    """(head in float32, eval mode; drafting vocabulary ids; config) from ``folder``, checked against ``target``."""
    config = read_config(folder)
    check_target(config, target, folder)
    shape = HeadShape(**config["shape"])
    if shape != HeadShape.of(target.model):
        raise ValueError(f"the head in {folder} has shapes {shape}, the target's layers {HeadShape.of(target.model)}")
    tensors = load_file(str(Path(folder) / "head.safetensors"))
    draft_vocab = tensors.pop("draft_vocab")
    head = EagleHead(shape)
    head.load_state_dict({name: t.float() for name, t in tensors.items()})
    return head.eval().requires_grad_(False), draft_vocab, config


def shipped_head(target: LoadedModel) -> Path:
    """The folder of the head shipped for a bundled target; ValueError naming the fix when there is none."""
    folder = SHIPPED / target.name
    if not (folder / "config.json").is_file():
        shipped = sorted(p.name for p in SHIPPED.iterdir() if (p / "config.json").is_file()) if SHIPPED.is_dir() else []
        raise ValueError(
            f"no EAGLE head is shipped for {target.name!r} (shipped: {', '.join(shipped) or 'none'}); train one with "
            f"`specdecode train-head --target ... --out DIR` and pass head=DIR (CLI: --head DIR)"
        )
    return folder
