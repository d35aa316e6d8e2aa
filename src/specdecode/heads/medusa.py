"""Medusa heads (Medusa-1, Cai et al. 2024): K residual blocks on the target's last hidden state, read out by
the target's frozen final norm and LM head, and their saved format.

Positions. f_t is the target's feature at position t (its last layer's output, before the final norm); the
target's own read-out of f_t is its law of the token at t+1. Head i (i = 0..K-1) reads f_t alone and guesses
the token at t+i+2: head 0 the token after the target's own next token. While decoding, the target has scored
every context token but the newest (n = len(context); the newest, at n-1, leads the next pass), so the newest
feature is f_{n-2}, whose read-out chose the newest token; head i then guesses the token at n+i, the draft's
(i+1)-th. As in Medusa-1 the heads never see the newest token itself: at temperature 0 it is f_{n-2}'s argmax;
when it was sampled or recovered from a rejection, the heads guess as if it were the target's likeliest.

Head i: x = f_t / rms(f_t); y_i = x + SiLU(W_i x + b_i); logits_i = LM head(final norm(y_i)), the norm and LM
head the target's (``TargetParts``, restricted to a drafting vocabulary). W_i and b_i start at zero, so that
each head starts as the target's own next-token read-out. Only W and b are trained and stored.

Their training: ``training.medusa``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..models.loaded import LoadedModel
from ..version import __version__
from .model import text_config
from .saved import SHIPPED, check_target, target_identity

FORMAT = "specdecode-medusa-heads"
VERSION = 1
SHIPPED_MEDUSA = SHIPPED / "medusa"


class MedusaHeads(nn.Module):
    """K residual blocks y_i = x + SiLU(W_i x + b_i) over x = f / rms(f) (see the module docstring)."""

    def __init__(self, hidden_size: int, num_heads: int, eps: float) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"Medusa needs at least one head, got {num_heads}")
        self.hidden_size, self.num_heads, self.eps = hidden_size, num_heads, eps
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))
        self._int8 = None  # the K blocks as one int8 matrix [K·H, H] (``to_int8``)

    def forward(self, features: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """The first ``heads`` (default all) heads' outputs [n, heads, H] for target features [n, H] (pre-norm);
        the target's final norm and LM head read them out."""
        k = self.num_heads if heads is None else heads
        x = F.rms_norm(features, (self.hidden_size,), eps=self.eps)
        if self._int8 is not None:
            mixed = self._int8(x).float().view(-1, self.num_heads, self.hidden_size)[:, :k]
        else:
            mixed = torch.einsum("nh,koh->nko", x, self.weight[:k].to(x.dtype)) + self.bias[:k].to(x.dtype)
        return x[:, None, :] + F.silu(mixed)

    def to_int8(self) -> MedusaHeads:
        """Run the K blocks as one int8 weight-only matrix product on bfloat16 activations (a quarter of float32's
        bytes: drafting reads them after a target pass has evicted them from the caches); in place, drafting
        only."""
        from ..models.formats.weights import Int8Linear

        self._int8 = Int8Linear.quantize(self.weight.reshape(-1, self.hidden_size), self.bias.reshape(-1))
        return self


# --- the saved format -----------------------------------------------------------------------------------------


def save_heads(
    folder: str | Path,
    heads: MedusaHeads,
    draft_vocab: torch.Tensor,
    target: LoadedModel,
    training: dict[str, Any] | None = None,
) -> Path:
    """Write ``heads.safetensors`` (W, b in bfloat16; the drafting vocabulary's ids, most useful first) and
    ``config.json`` into ``folder``; return the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in heads.state_dict().items()}
    tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    save_file(tensors, str(folder / "heads.safetensors"), metadata={"format": FORMAT})
    config = {
        "format": FORMAT,
        "version": VERSION,
        "specdecode": __version__,
        "target": target_identity(target),
        "hidden_size": heads.hidden_size,
        "num_heads": heads.num_heads,
        "rms_norm_eps": heads.eps,
        "draft_vocab_size": int(draft_vocab.numel()),
        "training": training or {},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def load_heads(folder: str | Path, target: LoadedModel) -> tuple[MedusaHeads, torch.Tensor, dict[str, Any]]:
    """(heads in float32, eval mode; drafting vocabulary ids; config) from ``folder``, checked against ``target``."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file() or not (folder / "heads.safetensors").is_file():
        raise FileNotFoundError(f"{folder} holds no Medusa heads (it needs config.json and heads.safetensors)")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ValueError(f"{path} is not a {FORMAT} version {VERSION} config")
    check_target(config, target, folder, command="train-medusa")
    hidden = text_config(target.model).hidden_size
    if config["hidden_size"] != hidden or config["target"]["vocab_size"] != target.vocab_size:
        raise ValueError(
            f"the Medusa heads in {folder} read hidden size {config['hidden_size']} and vocabulary "
            f"{config['target']['vocab_size']}; the target has {hidden} and {target.vocab_size}"
        )
    tensors = load_file(str(folder / "heads.safetensors"))
    draft_vocab = tensors.pop("draft_vocab")
    heads = MedusaHeads(hidden, config["num_heads"], config["rms_norm_eps"])
    heads.load_state_dict({name: t.float() for name, t in tensors.items()})
    return heads.eval().requires_grad_(False), draft_vocab, config


def shipped_heads(target: LoadedModel) -> Path:
    """The folder of the Medusa heads shipped for a bundled target; ValueError naming the fix when there are none."""
    folder = SHIPPED_MEDUSA / target.name
    if not (folder / "config.json").is_file():
        found = [p.parent.name for p in SHIPPED_MEDUSA.glob("*/config.json")] if SHIPPED_MEDUSA.is_dir() else []
        raise ValueError(
            f"no Medusa heads are shipped for {target.name!r} (shipped: {', '.join(sorted(found)) or 'none'}); "
            "train them with `specdecode train-medusa --target ... --out DIR` and pass heads=DIR (CLI: --heads DIR)"
        )
    return folder
