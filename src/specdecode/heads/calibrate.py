"""The head's sampling temperature: a factor on the request's temperature that makes the head's law overlap the
target's most.

A chain guess drawn from the head's law q is accepted with probability ``sum_x min(p(x), q(x))`` (p the target's
law at the request's temperature T). The head is trained against the target's law at temperature 1; how its
sharpness compares at other temperatures is whatever training left. Drafting at temperature ``T * factor(T)``
instead of T changes only q, never what the verification rule emits, so any factor is exact; the factor that
maximises the held-out overlap (measured without top-k/top-p) is found once, after training
(``training.calibrate``), and stored with the head (config.json ``sampling_calibration``). The shipped SmolLM2
heads are a little flatter than the target (best factors 0.85-0.95 on sampled held-out chats): +0.3-0.6 points of
first-guess overlap there, +1.6-3.3 points of acceptance on mt_bench (docs/HEADS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
