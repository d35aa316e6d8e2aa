"""Issue 17: EAGLE-3's fusion of low, middle and high layer features against the last layer alone, at equal data.

Both heads train on the same sequences, batches and seed; only the head's first-guess input differs:
  last:  f_t (the last layer's output, before the final norm), as the shipped head reads
  fused: W · [norm(h^a_t), norm(h^b_t), norm(f_t)] for --layers a,b,last (W starts as the identity on f_t's
         block, so the fused head starts where the other does); deeper guesses read the head's own output
Held-out top-1 agreement with the target at depths 1..5 is printed per variant. The loss weights, learning rate
and epochs are options, so the same script measures EAGLE-3's loss (--feature-weight 0 --ce-weight 1) too.

    python scripts/head_fusion_ablation.py --limit 300 --epochs 2 --cache /tmp/fx-cache --out /tmp/fx-out

The features of all the layers are cached once (--cache) and shared by every run. Results: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.commands import load
from specdecode.heads.model import EagleHead, HeadShape, TargetParts, unrolled
from specdecode.heads.train import (
    EVAL_DEPTHS,
    FeatureCache,
    TrainSettings,
    batch_tensors,
    choose_draft_vocab,
    head_loss,
    read_samples,
    training_loop,
)


class MultiLayerCache(FeatureCache):
    """Per sequence [T, len(layers) * H]: the residual stream after each of ``layers`` (the last: before the norm)."""

    layers: tuple[int, ...] = ()

    @torch.inference_mode()
    def _extract(self, ids):
        decoder = self._model().get_decoder()
        last: list[torch.Tensor] = []
        hook = decoder.norm.register_forward_pre_hook(lambda _m, a: last.append(a[0]))
        try:  # hidden_states: [embeddings, after layer 0, ..., after the last layer and the final norm]
            states = decoder(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states
        finally:
            hook.remove()
        final = len(states) - 2
        return torch.cat([(last[0] if i == final else states[i + 1])[0].float() for i in self.layers], dim=-1)


class Fuse(nn.Module):
    def __init__(self, hidden: int, count: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.count, self.eps = hidden, count, eps
        self.norms = nn.Parameter(torch.ones(count, hidden))
        self.proj = nn.Linear(count * hidden, hidden, bias=False)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, (count - 1) * hidden :] = torch.eye(hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        parts = features.view(*features.shape[:-1], self.count, self.hidden)
        normed = F.rms_norm(parts, (self.hidden,), eps=self.eps) * self.norms.to(parts.dtype)
        return self.proj(normed.flatten(-2))


class Model(nn.Module):
    def __init__(self, head: EagleHead, fuse: Fuse | None) -> None:
        super().__init__()
        self.head, self.fuse = head, fuse

    def inputs(self, features: torch.Tensor) -> torch.Tensor:
        return features[:, -self.head.shape.hidden_size :] if self.fuse is None else self.fuse(features)


def loss_of(model: Model, parts: TargetParts, batch, settings: TrainSettings, scale: float):
    """train.head_loss, the head's first pass reading ``model.inputs`` (fused or the last layer)."""
    features, tokens, positions = batch
    last = features[:, -model.head.shape.hidden_size :]
    return head_loss(model.head, parts, (last, tokens, positions), settings, scale, inputs=model.inputs(features))


@torch.no_grad()
def held_out(model: Model, parts: TargetParts, full_rows, cache, sequences) -> list[float]:
    hidden = model.head.shape.hidden_size
    hits, counts = [0] * EVAL_DEPTHS, [0] * EVAL_DEPTHS
    for i in range(len(sequences)):
        features, tokens, positions = batch_tensors(cache, "h", sequences, [i])
        normed = F.rms_norm(features[:, -hidden:], (hidden,), parts.norm_weight, parts.eps)
        target_next = (normed @ full_rows.T).argmax(-1).roll(-1)
        for j, (predicted, valid) in enumerate(
            unrolled(model.head, parts, model.inputs(features), tokens, positions, EVAL_DEPTHS)
        ):
            logits = parts.logits(predicted[valid])
            counts[j] += int(valid.sum())
            hits[j] += int((parts.to_vocab(logits.argmax(-1)) == target_next[valid]).sum())
    return [round(h / c, 4) for h, c in zip(hits, counts, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="sharegpt")
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--layers", default="2,15,29")
    parser.add_argument("--variants", default="last,fused")
    parser.add_argument("--cache", default="/tmp/fusion-cache")
    parser.add_argument("--out", default="/tmp/fusion-out")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--ce-weight", type=float, default=0.1)
    parser.add_argument("--feature-weight", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--held-out", type=int, default=32)
    args = parser.parse_args()
    target = load("smollm2", "float32", "none")
    layers = tuple(int(x) for x in args.layers.split(","))
    settings = TrainSettings(
        data=args.data, limit=args.limit, epochs=args.epochs, draft_vocab=args.draft_vocab, lr=args.lr,
        ce_weight=args.ce_weight, feature_weight=args.feature_weight, checkpoint_every=10**6, held_out=args.held_out,
    )  # fmt: skip
    held, train, stats = read_samples(target, settings)
    MultiLayerCache.layers = layers
    cache = MultiLayerCache(Path(args.cache), target, torch.bfloat16)
    hidden = target.model.config.hidden_size
    squares = [cache.get(f"h{i}", ids)[1:, -hidden:].square().mean() for i, ids in enumerate(held)]
    scale = float(torch.stack(squares).mean().sqrt())
    draft_vocab = choose_draft_vocab(train, target.vocab_size, settings.draft_vocab)
    parts = TargetParts(target.model, target.vocab_size, draft_vocab)
    from specdecode.heads.model import lm_head_rows

    full_rows = lm_head_rows(target.model)[: target.vocab_size]
    results = {}
    for variant in args.variants.split(","):
        torch.manual_seed(settings.seed)
        head = EagleHead(HeadShape.of(target.model))
        head.layer.load_target_layer(target.model.get_decoder().layers[-1], scale, target.model)
        fuse = Fuse(hidden, len(layers), float(target.model.config.rms_norm_eps)) if variant == "fused" else None
        model = Model(head, fuse)
        out = Path(args.out) / variant
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpoint.pt").unlink(missing_ok=True)
        started = time.perf_counter()
        trained = training_loop(
            model, settings, cache, train, lambda b, m=model: loss_of(m, parts, b, settings, scale),
            target.vocab_size, out / "checkpoint.pt", None, stats,
        )  # fmt: skip
        elapsed = time.perf_counter() - started
        accuracy = held_out(model, parts, full_rows, cache, held)
        results[variant] = {"top1_by_depth": accuracy, "tokens": trained.tokens, "seconds": round(elapsed)}
        print(variant, json.dumps(results[variant]), flush=True)
        torch.save(model.state_dict(), out / "model.pt")
    print(json.dumps({"layers": layers, "train_tokens": sum(map(len, train)), **results}))


if __name__ == "__main__":
    main()
