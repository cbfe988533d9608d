"""Holding a virtual model's large-model share: the feedback loop in kvpilot, and the cap and
floor that every Envoy keeps on its own.

Envoys report the score of every request to a virtual model (``xdsserver.difficultylog``).
``ShareController`` keeps the scores of the last ``window`` seconds and picks the threshold that
would have sent ``share`` percent of them to the large model: the score distribution's upper
quantile. Scores that tie at the threshold (a classifier that answers "hard" or "easy" only)
go to the large model with the probability ``tie`` that makes the share come out right, so
the share holds even when the scorer says the same thing about everything.

Hysteresis: the threshold moves only when the one in force would give a share more than
``deadband`` points from the target on the recent scores, so a steady mix does not cause a
configuration push per second. The lag between a change of mix and the new threshold in every
Envoy is the decision interval plus one configuration push (about a second each).

``ShareGuard`` is the cap and the floor, evaluated by each Envoy worker over its own recent
decisions (the Lua filter holds the same arithmetic): a request that would take the large
model above the cap goes to the small one, and the other way round below the floor. It holds
whatever the scorer says and whether or not kvpilot is reachable.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

GUARD_WINDOW = 200
"""Requests over which an Envoy worker counts its large-model share (the decay's time constant)."""
GUARD_WARMUP = 20
"""Requests a worker sees before the floor applies (the cap applies from the first)."""


@dataclass(frozen=True, slots=True)
class ShareDecision:
    """Where a virtual model's threshold stands, and why."""

    threshold: float
    tie: float
    """Probability that a request scoring exactly ``threshold`` takes the large model."""
    expected: float
    """Percent of the window's scores this threshold sends to the large model."""
    samples: int
    """Scores in the window."""


def split(scores: list[float], share: float) -> tuple[float, float]:
    """Threshold and tie probability that send ``share`` (0 to 1) of ``scores`` above it.

    ``scores`` sorted ascending. A request goes large when its score is above the threshold,
    or equal to it with the tie probability."""
    n = len(scores)
    if n == 0:
        return 0.5, 0.0
    wanted = share * n
    if wanted <= 0:
        return scores[-1], 0.0
    if wanted >= n:
        return scores[0], 1.0
    threshold = scores[n - 1 - int(wanted)]
    above = n - bisect.bisect_right(scores, threshold)
    ties = bisect.bisect_right(scores, threshold) - bisect.bisect_left(scores, threshold)
    tie = min(1.0, max(0.0, (wanted - above) / ties))
    return threshold, round(tie, 4)


def expected_share(scores: list[float], threshold: float, tie: float) -> float:
    """Fraction of sorted ``scores`` that ``threshold`` and ``tie`` send to the large model."""
    if not scores:
        return 0.0
    above = len(scores) - bisect.bisect_right(scores, threshold)
    ties = bisect.bisect_right(scores, threshold) - bisect.bisect_left(scores, threshold)
    return (above + tie * ties) / len(scores)


class ShareController:
    """Moves one virtual model's threshold so the large model keeps ``share`` percent."""

    def __init__(
        self,
        share: float,
        threshold: float,
        *,
        window: float = 10.0,
        min_samples: int = 50,
        deadband: float = 2.0,
        max_samples: int = 20_000,
    ) -> None:
        self.share = share
        self.window = window
        """Seconds of scores the quantile is taken over."""
        self.min_samples = min_samples
        """Scores needed before the configured threshold gives way to a learned one."""
        self.deadband = deadband
        """Points of share the threshold in force may miss by before it moves."""
        self.max_samples = max_samples
        self.decision = ShareDecision(threshold=threshold, tie=0.0, expected=share, samples=0)
        self._scores: deque[tuple[float, float]] = deque()

    def observe(self, at: float, score: float) -> None:
        """One request's score, reported by an Envoy at wall-clock time ``at``."""
        if math.isfinite(score):
            self._scores.append((at, min(1.0, max(0.0, score))))
            if len(self._scores) > self.max_samples:
                self._scores.popleft()

    def decide(self, now: float) -> ShareDecision:
        """The decision in force after looking at the scores of the last ``window`` seconds."""
        while self._scores and self._scores[0][0] < now - self.window:
            self._scores.popleft()
        scores = sorted(score for _, score in self._scores)
        if len(scores) < self.min_samples:
            return self.decision
        current = self.decision
        now_share = expected_share(scores, current.threshold, current.tie) * 100
        if abs(now_share - self.share) <= self.deadband and current.samples:
            self.decision = ShareDecision(current.threshold, current.tie, now_share, len(scores))
            return self.decision
        threshold, tie = split(scores, self.share / 100)
        self.decision = ShareDecision(
            threshold=round(threshold, 6),
            tie=tie,
            expected=expected_share(scores, threshold, tie) * 100,
            samples=len(scores),
        )
        return self.decision


class ShareGuard:
    """One Envoy worker's cap and floor (the Lua filter keeps the same state per worker)."""

    def __init__(self, cap: float, floor: float) -> None:
        self.cap = cap / 100
        self.floor = floor / 100
        self.decay = 1 - 1 / GUARD_WINDOW
        self.large = 0.0
        self.total = 0.0
        self.seen = 0

    def admit(self, large: bool) -> bool:
        """The scorer's choice, held within cap and floor; True: the large model."""
        self.seen += 1
        total = self.total * self.decay + 1
        if large and (self.large * self.decay + 1) / total > self.cap:
            large = False
        elif (
            not large and self.seen > GUARD_WARMUP and self.large * self.decay / total < self.floor
        ):
            large = True
        self.large = self.large * self.decay + (1 if large else 0)
        self.total = total
        return large


def chooses_large(score: float, threshold: float, tie: float, draw: float) -> bool:
    """The threshold's choice for one score; ``draw`` uniform in [0, 1)."""
    return score > threshold or (score == threshold and draw < tie)
