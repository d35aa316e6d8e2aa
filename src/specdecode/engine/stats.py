"""Counters and timings of speculative decoding, per request and aggregated."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    """What one request (or a sum of requests) did.

    ``per_position[i]`` counts draft tokens accepted at draft position i+1 and ``per_position_reached[i]``
    the rounds in which position i+1 was tested (all earlier positions accepted), so
    ``per_position[i] / per_position_reached[i]`` is the conditional acceptance a_{i+1}. For a token tree
    the position is the depth: depth i+1 is tested when the accepted path reaches a node with children, and
    ``drafted`` counts every node verified. ``per_depth_drafted[i]`` sums the nodes drafted at depth i+1 (1
    per round for a chain reaching it); ``tree_rounds`` counts the rounds that verified a tree, and
    ``sibling_accepts`` the accepted tree nodes that are not their parent's first child (a later sibling kept
    after the first was rejected: the tree paid for its width). ``forced`` counts the tokens a grammar forced,
    drafted for free and always accepted: counted apart, outside ``drafted`` and ``accepted``.
    """

    generated: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    per_position: list[int] = field(default_factory=list)
    per_position_reached: list[int] = field(default_factory=list)
    per_depth_drafted: list[int] = field(default_factory=list)
    tree_rounds: int = 0
    sibling_accepts: int = 0
    forced: int = 0
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
    def drafted_per_round(self) -> float:
        """Draft tokens (tree nodes) verified per target pass."""
        return self.drafted / self.rounds if self.rounds else 0.0

    @property
    def accepted_per_round(self) -> float:
        """Mean accepted length per target pass (draft tokens kept, the recovered/bonus token not counted)."""
        return self.accepted / self.rounds if self.rounds else 0.0

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
        """Count one target pass that checked a chain of ``drafted`` tokens and kept ``accepted`` of them."""
        self._record([1] * drafted, accepted, accepted < drafted)

    def record_tree_round(
        self, nodes_per_depth: list[int], accepted: int, rejected: bool, sibling_accepts: int = 0
    ) -> None:
        """Count one target pass over a tree (``nodes_per_depth[i]`` nodes at depth i+1) whose accepted path
        has ``accepted`` nodes, ``sibling_accepts`` of them not their parent's first child; ``rejected``: the
        path's last node (or the root) has children, all rejected."""
        self.tree_rounds += 1
        self.sibling_accepts += sibling_accepts
        self._record(nodes_per_depth, accepted, rejected)

    def _record(self, nodes_per_depth: list[int], accepted: int, rejected: bool) -> None:
        self.rounds += 1
        self.drafted += sum(nodes_per_depth)
        self.accepted += accepted
        self.rejections += rejected
        reached = accepted + rejected
        if reached > len(self.per_position):
            grow = reached - len(self.per_position)
            self.per_position.extend([0] * grow)
            self.per_position_reached.extend([0] * grow)
        for i in range(reached):
            self.per_position_reached[i] += 1
            self.per_position[i] += i < accepted
        if len(nodes_per_depth) > len(self.per_depth_drafted):
            self.per_depth_drafted.extend([0] * (len(nodes_per_depth) - len(self.per_depth_drafted)))
        for i, nodes in enumerate(nodes_per_depth):
            self.per_depth_drafted[i] += nodes

    def merge(self, other: DecodeStats) -> DecodeStats:
        """Sum of two sets of counters and timings."""

        def add(xs: list[int], ys: list[int]) -> list[int]:
            width = max(len(xs), len(ys))
            return [a + b for a, b in zip(xs + [0] * (width - len(xs)), ys + [0] * (width - len(ys)), strict=True)]

        return DecodeStats(
            generated=self.generated + other.generated,
            rounds=self.rounds + other.rounds,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            rejections=self.rejections + other.rejections,
            per_position=add(self.per_position, other.per_position),
            per_position_reached=add(self.per_position_reached, other.per_position_reached),
            per_depth_drafted=add(self.per_depth_drafted, other.per_depth_drafted),
            tree_rounds=self.tree_rounds + other.tree_rounds,
            sibling_accepts=self.sibling_accepts + other.sibling_accepts,
            forced=self.forced + other.forced,
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
            "drafted_per_round",
            "accepted_per_round",
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
