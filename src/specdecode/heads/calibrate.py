"""The head's sampling temperature: a factor on the request's temperature that makes the head's law overlap the
target's most.

A chain guess drawn from the head's law q is accepted with probability ``sum_x min(p(x), q(x))`` (p the target's
law at the request's temperature T). The head is trained against the target's law at temperature 1; how its
sharpness compares at other temperatures is whatever training left. Drafting at temperature ``T * factor(T)``
instead of T changes only q, never what the verification rule emits, so any factor is exact; the factor that
maximises the held-out overlap (measured without top-k/top-p) is found once, after training, and stored with the
head (config.json ``sampling_calibration``). The shipped SmolLM2 heads are a little flatter than the target (best
factors 0.85-0.95 on sampled held-out chats): +0.3-0.6 points of first-guess overlap there, +1.6-3.3 points of
acceptance on mt_bench (docs/HEADS.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .model import EagleHead, TargetParts, unrolled

TEMPERATURES = (0.6, 0.8, 1.0, 1.2)
FACTORS = (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.45, 1.6)
DEPTHS = 2  # the overlap is measured at depths 1..DEPTHS; the factor is chosen on depth 1 (a chain's first guess)


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum_x min(p(x), q(x))`` over the last dimension: the probability that a token drawn from q is accepted
    by the rule accept-with-probability ``min(1, p/q)`` (one minus the total variation distance)."""
    return torch.minimum(p, q).sum(-1)


@dataclass(frozen=True)
class TemperatureCalibration:
    """Per request temperature (ascending), the factor the head's temperature is multiplied by."""

    temperatures: tuple[float, ...] = ()
    factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.temperatures) != len(self.factors):
            raise ValueError("a temperature calibration needs one factor per temperature")
        if any(b <= a for a, b in zip(self.temperatures, self.temperatures[1:], strict=False)):
            raise ValueError(f"calibration temperatures must ascend, got {self.temperatures}")
        if any(not f > 0 for f in self.factors):
            raise ValueError(f"calibration factors must be positive, got {self.factors}")

    def factor(self, temperature: float) -> float:
        """The factor at ``temperature``: linear between calibrated temperatures, the nearest one's outside them,
        1 with no calibration."""
        ts, fs = self.temperatures, self.factors
        if not ts:
            return 1.0
        if temperature <= ts[0]:
            return fs[0]
        for (t0, f0), (t1, f1) in zip(zip(ts, fs, strict=True), zip(ts[1:], fs[1:], strict=True), strict=False):
            if temperature <= t1:
                return f0 + (f1 - f0) * (temperature - t0) / (t1 - t0)
        return fs[-1]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TemperatureCalibration:
        """The calibration a head's config.json stores (none for heads saved before calibration existed)."""
        stored = config.get("sampling_calibration") or {}
        return cls(tuple(stored.get("temperatures", ())), tuple(stored.get("factors", ())))


@torch.no_grad()
def temperature_overlaps(
    head: EagleHead,
    parts: TargetParts,
    full_rows: torch.Tensor,
    sequences: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    temperatures: tuple[float, ...] = TEMPERATURES,
    factors: tuple[float, ...] = FACTORS,
    depths: int = DEPTHS,
) -> dict[float, dict[float, list[float]]]:
    """Mean overlap of the head's law at temperature ``T * factor`` with the target's at T, per T, factor and
    depth 1..``depths``, over every position of ``sequences`` (each: the target's features [n, H], tokens [n],
    positions [n]), teacher-forced as in ``held_out_accuracy``: at depth d the head has read true features up to
    t-d+1 and its own predictions after. The head's law is zero outside its drafting vocabulary."""
    sums = {t: {f: [0.0] * depths for f in factors} for t in temperatures}
    counts = [0] * depths
    for sequence in sequences:
        features, tokens, positions = (t.to(full_rows.device) for t in sequence)
        normed = F.rms_norm(features.float(), (parts.hidden_size,), parts.norm_weight, parts.eps)
        target_logits = (normed @ full_rows.T).roll(-1, 0)  # row t: the target's law for the token after t+1
        # p restricted to the drafting vocabulary: q is zero elsewhere, so min(p, q) is too
        target_probs = {t: torch.softmax(target_logits / t, -1)[:, parts.draft_vocab] for t in temperatures}
        for j, (predicted, valid) in enumerate(unrolled(head, parts, features, tokens, positions, depths)):
            head_logits = parts.logits(predicted[valid])
            counts[j] += head_logits.shape[0]
            for t in temperatures:
                p = target_probs[t][valid]
                for f in factors:
                    sums[t][f][j] += float(overlap(p, torch.softmax(head_logits / (t * f), -1)).sum())
    return {
        t: {f: [round(s / max(c, 1), 4) for s, c in zip(row, counts, strict=True)] for f, row in by_f.items()}
        for t, by_f in sums.items()
    }


def calibrate(overlaps: dict[float, dict[float, list[float]]]) -> TemperatureCalibration:
    """Per temperature, the factor with the highest depth-1 overlap (ties: the one nearest 1)."""
    temperatures = tuple(sorted(overlaps))
    factors = tuple(max(overlaps[t], key=lambda f: (overlaps[t][f][0], -abs(f - 1.0))) for t in temperatures)
    return TemperatureCalibration(temperatures, factors)


def calibration_record(overlaps: dict[float, dict[float, list[float]]]) -> dict[str, Any]:
    """What config.json stores: the chosen factors and the overlaps they were chosen from."""
    chosen = calibrate(overlaps)
    return {
        "temperatures": list(chosen.temperatures),
        "factors": list(chosen.factors),
        "overlap_by_factor": {str(t): {str(f): v for f, v in by_f.items()} for t, by_f in overlaps.items()},
    }


def calibration_summary(record: dict[str, Any]) -> str:
    """One line for train-head's report: the factor and the held-out first-guess overlap it buys, per T."""
    parts = []
    for t, f in zip(record["temperatures"], record["factors"], strict=True):
        by_factor = record["overlap_by_factor"][str(t)]
        raw = by_factor.get(str(1.0), [float("nan")])[0]
        parts.append(f"T {t:g} x{f:g} ({raw:.3f} -> {by_factor[str(f)][0]:.3f})")
    return "sampling: the head drafts at T x factor (held-out first-guess overlap raw -> calibrated): " + ", ".join(
        parts
    )
