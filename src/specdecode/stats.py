"""Counters and timings of speculative decoding, per request and aggregated."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    """What one request (or a sum of requests) did.

    ``per_position[i]`` counts draft tokens accepted at draft position i+1 and ``per_position_reached[i]``
    the rounds in which position i+1 was tested (all earlier positions accepted), so
    ``per_position[i] / per_position_reached[i]`` is the conditional acceptance a_{i+1}.
    """

    generated: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    per_position: list[int] = field(default_factory=list)
    per_position_reached: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 if nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance α = accepted / (accepted + rejections): tokens after a rejection are untested."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Generated tokens per target forward pass (accepted + recovered/bonus)."""
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        """Conditional acceptance a_i at each draft position (0.0 where never reached)."""
        return [a / r if r else 0.0 for a, r in zip(self.per_position, self.per_position_reached, strict=True)]

    @property
    def other_seconds(self) -> float:
        """Wall time outside prefill, drafting and verification (the loop's own overhead)."""
        return max(0.0, self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per wall-clock second, prefill included."""
        return self.generated / self.total_seconds if self.total_seconds else 0.0

    def record_round(self, drafted: int, accepted: int) -> None:
        """Count one target pass that checked ``drafted`` tokens and kept ``accepted`` of them."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        rejected = accepted < drafted
        self.rejections += rejected
        reached = accepted + rejected
        if reached > len(self.per_position):
            grow = reached - len(self.per_position)
            self.per_position.extend([0] * grow)
            self.per_position_reached.extend([0] * grow)
        for i in range(reached):
            self.per_position_reached[i] += 1
            self.per_position[i] += i < accepted

    def merge(self, other: DecodeStats) -> DecodeStats:
        """Sum of two sets of counters and timings."""
        width = max(len(self.per_position), len(other.per_position))

        def pad(xs: list[int]) -> list[int]:
            return xs + [0] * (width - len(xs))

        return DecodeStats(
            generated=self.generated + other.generated,
            rounds=self.rounds + other.rounds,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            rejections=self.rejections + other.rejections,
            per_position=[a + b for a, b in zip(pad(self.per_position), pad(other.per_position), strict=True)],
            per_position_reached=[
                a + b for a, b in zip(pad(self.per_position_reached), pad(other.per_position_reached), strict=True)
            ],
            prefill_seconds=self.prefill_seconds + other.prefill_seconds,
            draft_seconds=self.draft_seconds + other.draft_seconds,
            verify_seconds=self.verify_seconds + other.verify_seconds,
            total_seconds=self.total_seconds + other.total_seconds,
        )

    def to_dict(self) -> dict:
        """Counters, timings and the derived rates, JSON-ready."""
        out = asdict(self)
        for name in (
            "acceptance_rate",
            "alpha",
            "tokens_per_round",
            "per_position_rate",
            "other_seconds",
            "tokens_per_second",
        ):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        """One line for people."""
        return (
            f"{self.generated} tokens in {self.total_seconds:.2f}s ({self.tokens_per_second:.1f} tok/s), "
            f"{self.rounds} target passes, {self.tokens_per_round:.2f} tokens/pass, "
            f"acceptance {self.acceptance_rate:.1%} (α {self.alpha:.2f}), "
            f"draft {self.draft_seconds:.2f}s verify {self.verify_seconds:.2f}s other {self.other_seconds:.2f}s"
        )
