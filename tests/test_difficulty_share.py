"""The large-model share of a virtual model holds while the traffic mix changes; the cap and the
floor hold whatever the scorer says (simulation of the controller and the Envoy arithmetic)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from signals.difficultyshare import (
    ShareController,
    ShareGuard,
    chooses_large,
    expected_share,
    split,
)

RATE = 50
"""Requests per second of the simulated traffic."""


def easy_or_hard(hard_share: Callable[[int], float], rng: random.Random) -> Callable[[int], float]:
    """A scorer that tells easy from hard imperfectly: easy prompts score around 0.2, hard
    ones around 0.8 (Beta distributions that overlap)."""

    def score(second: int) -> float:
        if rng.random() < hard_share(second):
            return rng.betavariate(8, 2)
        return rng.betavariate(2, 8)

    return score


def run(
    seconds: int,
    scorer: Callable[[int], float],
    *,
    share: float = 20,
    cap: float = 30,
    floor: float = 10,
    controller_runs: bool = True,
    seed: int = 1,
    lag: int = 2,
) -> list[float]:
    """Large-model share (percent) of each minute. Envoy applies the threshold kvpilot
    decided ``lag`` seconds earlier: scores reach kvpilot within 0.25 s (the access log's
    flush), it decides once a second and a push takes well under a second more."""
    rng = random.Random(seed)
    controller = ShareController(share, 0.5)
    guard = ShareGuard(cap, floor)
    threshold, tie = 0.5, 0.0
    pending: list[tuple[float, float]] = []
    minutes: list[list[bool]] = []
    for second in range(seconds):
        if second % 60 == 0:
            minutes.append([])
        for i in range(RATE):
            at = second + i / RATE
            value = scorer(second)
            large = guard.admit(chooses_large(value, threshold, tie, rng.random()))
            minutes[-1].append(large)
            controller.observe(at, value)
        if controller_runs:
            decision = controller.decide(second + 1)
            pending.append((decision.threshold, decision.tie))
            if len(pending) >= lag:
                threshold, tie = pending.pop(0)
    return [100 * sum(minute) / len(minute) for minute in minutes]


def mix(second: int) -> float:
    """Hard prompts go from 10% to 40% of traffic and back, two minutes each."""
    return 0.4 if 120 <= second < 240 else 0.1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_large_share_stays_within_3_points_every_minute_while_the_mix_changes(
    seed: int,
) -> None:
    rng = random.Random(seed)
    minutes = run(360, easy_or_hard(mix, rng), seed=seed)
    assert all(abs(minute - 20) <= 3 for minute in minutes), minutes


def test_without_the_controller_the_mix_change_moves_the_share() -> None:
    """The test above can fail: a fixed threshold lets the share follow the mix."""
    rng = random.Random(1)
    minutes = run(360, easy_or_hard(mix, rng), controller_runs=False, cap=100, floor=0)
    assert max(minutes) - min(minutes) > 20, minutes


def test_a_scorer_that_calls_everything_hard_still_gets_the_share() -> None:
    minutes = run(180, lambda second: 1.0)
    assert all(abs(minute - 20) <= 3 for minute in minutes), minutes


@pytest.mark.parametrize(("verdict", "bound"), [(1.0, 30), (0.0, 10)])
def test_cap_and_floor_hold_when_kvpilot_is_not_there_to_move_the_threshold(
    verdict: float, bound: float
) -> None:
    """Everything hard (or a classifier that stopped answering, with fallback large) and no
    threshold from kvpilot: each Envoy worker still keeps the large share at the cap; the
    same for the floor when everything is easy."""
    minutes = run(120, lambda second: verdict, controller_runs=False)
    assert all(abs(minute - bound) <= 1 for minute in minutes), minutes


def test_split_sends_the_share_above_the_threshold_and_breaks_ties_by_chance() -> None:
    scores = sorted([0.1] * 50 + [0.9] * 50)
    threshold, tie = split(scores, 0.2)
    assert threshold == 0.9 and tie == pytest.approx(0.4)
    assert expected_share(scores, threshold, tie) == pytest.approx(0.2)
    spread = sorted(i / 1000 for i in range(1000))
    threshold, tie = split(spread, 0.2)
    assert expected_share(spread, threshold, tie) == pytest.approx(0.2, abs=0.002)


def test_a_steady_mix_does_not_move_the_threshold_every_decision() -> None:
    rng = random.Random(5)
    controller = ShareController(20, 0.5)
    scorer = easy_or_hard(lambda second: 0.25, rng)
    thresholds = []
    for second in range(120):
        for i in range(RATE):
            controller.observe(second + i / RATE, scorer(second))
        thresholds.append(controller.decide(second + 1).threshold)
    moves = sum(1 for a, b in itertools.pairwise(thresholds[30:]) if a != b)
    assert moves < 20, moves
