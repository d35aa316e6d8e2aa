"""The pass-cost model: seconds of a target pass by its rows, and seconds a drafted token, learned online.

A pass of r rows (a request's newest token plus its draft; the server's batch: every request's) costs T(r)
seconds: the moving average of the times measured at r, else linear interpolation between the nearest measured
row counts, else past them the line through the extreme measured counts (never decreasing; a given ``slope``
instead for a fixed line), flat with one count, 1.0 before any. Per-row-count times matter: on a CPU T(r) is
often a step function of r (a GEMM kernel switch), which no line through two points describes.

Each estimate (a row count's time, a drafter's per-token time, a tree's size and drafting time) is a moving
average that ages: measured n rounds after its last measurement its old value keeps (1 - smoothing)^n of the
weight, but at least min(1 - smoothing, 1/2), so v(k) = T(k) / T(1) does not divide a fresh time by one taken a
hundred rounds earlier (forward times drift with the context and with what ran in between: through one plain
stretch the 1-token step fell from 3.24 to 2.74 ms while the 2-token time stayed at the 3.32 ms taken before it,
and v(2) read 1.21 instead of ~1.0). A new time first goes through the median of the estimate's last three taken
within ``RECENT_ROUNDS`` rounds (the lower of two), so a lone 2-3x spike (the OS, another thread) moves nothing.
A round is one ``observe_pass``. The engine's ``gamma="auto"`` and the server's policy read the same model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RECENT_ROUNDS = 16  # times taken within this many rounds are compared to filter out a lone spike


@dataclass
class PassCosts:
    """T(rows) in seconds (``seconds``: the measured row counts), seconds a drafted token per ``drafter`` (a name:
    "" for a decoder's one proposer, a hybrid's "copy" and "model" sides, the server's proposer names), and for a
    proposer that drafts trees the (rows, drafting seconds) of its trees per (drafter, γ). ``fixed`` costs never
    update (tests inject them)."""

    seconds: dict[int, float] = field(default_factory=dict)
    draft_token_seconds: dict[str, float] = field(default_factory=dict)
    slope: float | None = None  # seconds per row past the measured counts; None: the line through the extremes
    smoothing: float = 0.2
    fixed: bool = False
    tree_rounds: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    rounds: int = 0  # passes observed: the clock estimates age by
    measured_at: dict[object, int] = field(default_factory=dict)  # estimate -> the round it was last measured in
    recent: dict[object, list[tuple[int, float]]] = field(default_factory=dict)  # estimate -> its last (round, time)s

    @classmethod
    def line(
        cls, step_seconds: float, extra_row_seconds: float, draft_token_seconds: dict[str, float] | None = None
    ) -> PassCosts:
        """Fixed costs on a line: T(r) = step + (r - 1) · extra."""
        return cls({1: step_seconds}, dict(draft_token_seconds or {}), slope=extra_row_seconds, fixed=True)

    # --- measuring ----------------------------------------------------------------------------------

    def observe_pass(self, rows: int, seconds: float) -> None:
        """A target pass of ``rows`` rows took ``seconds``: one round on the clock."""
        if self.fixed:
            return
        self.rounds += 1
        self.seconds[rows] = self._average(("pass", rows), self.seconds.get(rows), seconds)

    def observe_draft(self, drafted: int, seconds: float, drafter: str = "") -> None:
        """``drafter`` drafted ``drafted`` tokens in ``seconds`` (a price: not a catch-up on undrafted tokens)."""
        if self.fixed or not drafted:
            return
        old = self.draft_token_seconds.get(drafter)
        self.draft_token_seconds[drafter] = self._average(("draft", drafter), old, seconds / drafted)

    def observe(
        self, verified: int, verify_seconds: float, drafted: int, draft_seconds: float | None, drafter: str = ""
    ) -> None:
        """One decoding round: its pass (``verified`` = drafted + 1 rows) and, unless ``draft_seconds`` is None
        (not a price: the proposer caught up on rounds it did not draft), its drafting."""
        self.observe_pass(verified, verify_seconds)
        if draft_seconds is not None:
            self.observe_draft(drafted, draft_seconds, drafter)

    def observe_tree(self, gamma: int, rows: int, draft_seconds: float, drafter: str = "") -> None:
        """A round at ``gamma`` drafted a token tree: ``rows`` verified (its nodes + 1), drafting took
        ``draft_seconds``. From then on that γ is priced as the trees ``drafter`` produces."""
        if self.fixed:
            return
        old = self.tree_rounds.get((drafter, gamma))
        keep = self._keep(("tree", drafter, gamma))
        self.tree_rounds[drafter, gamma] = (
            (float(rows), draft_seconds)
            if old is None
            else (keep * old[0] + (1 - keep) * rows, keep * old[1] + (1 - keep) * draft_seconds)
        )

    def forget_drafting(self) -> None:
        """Drop the drafting prices (per-token and trees), keep the pass times."""
        self.draft_token_seconds.clear()
        self.tree_rounds.clear()

    # --- reading ------------------------------------------------------------------------------------

    def pass_seconds(self, rows: int) -> float:
        """T(rows): measured, interpolated, or extrapolated (module doc); 1.0 before any measurement."""
        if rows in self.seconds:
            return self.seconds[rows]
        if not self.seconds:
            return 1.0
        counts = sorted(self.seconds)
        lo, hi = counts[0], counts[-1]
        slope = self.slope
        if slope is None:
            slope = max(0.0, (self.seconds[hi] - self.seconds[lo]) / (hi - lo)) if hi > lo else 0.0
        if rows > hi:
            return self.seconds[hi] + slope * (rows - hi)
        if rows < lo:
            return max(self.seconds[lo] - slope * (lo - rows), 0.5 * self.seconds[lo])
        below = max(c for c in counts if c < rows)
        above = min(c for c in counts if c > rows)
        w = (rows - below) / (above - below)
        return (1 - w) * self.seconds[below] + w * self.seconds[above]

    @property
    def step_seconds(self) -> float | None:
        """T(1), once measured."""
        return self.seconds.get(1)

    def verify_cost(self, tokens: int) -> float:
        """v(k) = T(k) / T(1): a k-token pass relative to a 1-token step (1 until the step is measured)."""
        step = self.step_seconds
        return self.pass_seconds(tokens) / step if step else 1.0

    def draft_cost(self, drafter: str = "") -> float:
        """c: a token ``drafter`` drafts relative to a 1-token step (0 until both are measured)."""
        seconds = self.draft_token_seconds.get(drafter)
        step = self.step_seconds
        return seconds / step if step and seconds is not None else 0.0

    def round_cost(self, gamma: int, drafter: str = "") -> float:
        """A round at γ in 1-token steps: v(γ+1) + γc for a chain; v(rows) + drafting for γ's measured trees."""
        tree = self.tree_rounds.get((drafter, gamma))
        if tree is None:
            return self.verify_cost(gamma + 1) + gamma * self.draft_cost(drafter)
        rows, draft_seconds = tree
        step = self.step_seconds
        return self.verify_cost(max(1, round(rows))) + (draft_seconds / step if step else 0.0)

    def frontier(self, cap: int, batch: int = 1) -> int:
        """The most draft rows worth pricing over a pass of ``batch`` plain rows: twice the deepest measured (1
        before any), at most ``cap``, so drafting grows 1, 2, 4, 8 instead of jumping to the cap on an
        extrapolated T. Fixed costs: ``cap``."""
        if self.fixed:
            return cap
        deepest = max([rows - batch for rows in self.seconds] + [gamma for _, gamma in self.tree_rounds], default=0)
        return min(cap, max(1, 2 * deepest))

    def rounds_since_step(self) -> int:
        """Rounds observed since T(1) was last measured (0 for fixed costs: they never go stale)."""
        return 0 if self.fixed else self.rounds - self.measured_at.get(("pass", 1), 0)

    # --- the moving averages ------------------------------------------------------------------------

    def _keep(self, estimate: object) -> float:
        """The weight an estimate's old value keeps now: (1 - smoothing)^n, n the rounds since its last
        measurement, at least min(1 - smoothing, 1/2) (a forward now and then takes 1.3-1.6x its usual time);
        records this round as its latest."""
        age = self.rounds - self.measured_at.get(estimate, self.rounds - 1)
        self.measured_at[estimate] = self.rounds
        keep = 1 - self.smoothing
        return max(min(keep, 0.5), keep ** max(1, age))

    def _average(self, estimate: object, old: float | None, new: float) -> float:
        keep = self._keep(estimate)
        new = self._filtered(estimate, new)
        return new if old is None else keep * old + (1 - keep) * new

    def _filtered(self, estimate: object, new: float) -> float:
        """The median of the estimate's last 3 times within ``RECENT_ROUNDS`` rounds (the lower of 2; the time
        itself when alone): moved a fifth to a half of the way by a lone spike, a per-k time not measured again for
        a while kept v(2) at 2.3 instead of 1.2 and sent γ auto to γ2-3 at 40% acceptance (docs/BENCHMARKS.md)."""
        times = [(at, t) for at, t in self.recent.get(estimate, []) if self.rounds - at < RECENT_ROUNDS]
        times = [*times[-2:], (self.rounds, new)]
        self.recent[estimate] = times
        values = sorted(t for _, t in times)
        return values[1] if len(values) == 3 else values[0]
