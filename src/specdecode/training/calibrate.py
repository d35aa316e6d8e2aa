"""Calibrating the head's sampling temperature after training (``heads.calibrate``: what the factor is and why
any factor is exact): the held-out overlap of the head's law with the target's per request temperature and
factor, the factor chosen at each temperature, and the record config.json stores.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from ..heads.calibrate import TemperatureCalibration
from ..heads.model import EagleHead, TargetParts, unrolled

TEMPERATURES = (0.6, 0.8, 1.0, 1.2)
FACTORS = (0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.45, 1.6)
DEPTHS = 2  # the overlap is measured at depths 1..DEPTHS; the factor is chosen on depth 1 (a chain's first guess)


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``sum_x min(p(x), q(x))`` over the last dimension: the probability that a token drawn from q is accepted
    by the rule accept-with-probability ``min(1, p/q)`` (one minus the total variation distance)."""
    return torch.minimum(p, q).sum(-1)


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
