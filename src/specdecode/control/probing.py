"""When plain decoding wins, speculate now and then anyway: a plain round observes no acceptance."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProbeSchedule:
    """After ``every`` plain verdicts in a row, one probe; the interval doubles after each probe (up to ``most``,
    None: no cap) and returns to ``every`` once speculation wins again."""

    every: int
    most: int | None = None
    _plain: int = 0
    _interval: int = 0

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"the probe interval must be >= 1, got {self.every}")
        self._interval = self.every

    def speculated(self) -> None:
        """Speculation won a decision: the next plain stretch waits ``every`` verdicts again."""
        self._plain = 0
        self._interval = self.every

    def plain(self) -> bool:
        """Count a plain verdict; True when this one becomes a probe."""
        self._plain += 1
        if self._plain < self._interval:
            return False
        self._plain = 0
        self._interval = 2 * self._interval if self.most is None else min(2 * self._interval, self.most)
        return True
