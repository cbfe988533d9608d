"""A ``capacityBound`` route over small batches takes the two fixed bounds instead of its
ladder (``signals.saturation.ladder_pays``, ``decide_capacity_route``): the rule, the
decisions (the same as a route without ``capacityBound``, round after round), what the route
keeps while telemetry is stale, and what its status says."""

from __future__ import annotations

import math

import pytest

from policies.models import BOUNDED_LOAD_LADDER
from signals.saturation import (
    CALM_SHARE,
    LADDER_MIN_BATCH,
    MIN_DWELL,
    SaturationDecision,
    decide_capacity_route,
    decide_saturation,
    ladder_pays,
    path_reason,
    saturated_fill,
    usable_batch,
)

USUAL = 125
SATURATED_AT = saturated_fill(USUAL)  # 0.8
NOW = 1000.0


def decide(
    previous: SaturationDecision | None,
    load: tuple[float, float] | None,
    *,
    now: float = NOW,
    saturated_at: float | None = SATURATED_AT,
) -> SaturationDecision:
    """One round for a pool whose every replica holds the mean (so the fill is mean / batch)."""
    fill = None if load is None else load[0] / load[1]
    return decide_capacity_route(
        previous,
        load,
        fill,
        now=now,
        ladder=BOUNDED_LOAD_LADDER,
        usual=USUAL,
        saturated_at=saturated_at,
    )


@pytest.mark.parametrize(
    ("batch", "pays"),
    [
        pytest.param(1, False, id="1"),
        pytest.param(2, False, id="2: not by the usable batch's floor of one"),
        pytest.param(8, False, id="8: 5.2 usable, 65%"),
        pytest.param(16, False, id="16: 12 usable, exactly three quarters"),
        pytest.param(16.5, True, id="16.5: just above"),
        pytest.param(17, True, id="17"),
        pytest.param(32, True, id="32: 26.3 usable, 82%"),
        pytest.param(128, True, id="128: 116.7 usable, 91%"),
        pytest.param(512, True, id="512"),
    ],
)
def test_the_ladder_pays_above_batches_of_16(batch: float, pays: bool) -> None:
    assert ladder_pays(batch) is pays
    assert LADDER_MIN_BATCH == 16
    if batch >= 4:  # above the usable batch's floor of one sequence, the rule as it reads
        assert pays is (usable_batch(batch) > CALM_SHARE * batch)


def test_at_batches_of_8_the_route_decides_as_the_fixed_bounds_round_after_round() -> None:
    """A pool at batch 8 whose mean in flight goes 1 to 7 and back, the loads that changed
    the ladder's rung 4 to 6 times a run: every round is the fixed bounds' decision, rung 0,
    and the twin changes only when the fixed bounds' would."""
    means = [1, 2, 4, 3, 5, 6.5, 7, 6, 5, 4.5, 4.5, 2, 1, 3, 4]
    mine: SaturationDecision | None = None
    fixed: SaturationDecision | None = None
    switches = 0
    for step, mean in enumerate(means):
        now = NOW + 2 * step
        before = mine
        mine = decide(mine, (mean, 8), now=now)
        fixed = decide_saturation(fixed, mean / 8, now=now, bound=SATURATED_AT)
        assert (mine.saturated, mine.since, mine.fill) == (fixed.saturated, fixed.since, fixed.fill)
        assert mine.factor == 0 and mine.ladder is False and mine.batch == 8
        assert mine.path == "batch 8: ladder needs > 16; fixed bounds"
        switches += before is not None and before.saturated != mine.saturated
    # Saturated at 6.5 of 8 (0.81), calm again at 4.5 (0.56) once the dwell is over.
    assert switches == 2
    assert mine.saturated is False


@pytest.mark.parametrize("batch", [8, 16])
def test_small_batches_take_the_fixed_bounds_from_the_first_record(batch: int) -> None:
    first = decide(None, (batch * 0.9, batch))
    assert first.ladder is False and first.factor == 0
    assert first.saturated is True  # a fill of 0.9 saturates at once, as the fixed bounds do
    assert first.path == f"batch {batch}: ladder needs > 16; fixed bounds"


@pytest.mark.parametrize("batch", [32, 128])
def test_batches_of_32_and_more_keep_the_ladder(batch: int) -> None:
    first = decide(None, (batch / 5, batch))
    # The first record: the loosest bound that fits (411% and 456%: 300), through the dwell.
    assert first.ladder is True and first.factor == 300
    later = decide(first, (batch / 5, batch), now=NOW + 60)
    assert later.factor == 300  # a fifth full: the top rung, as decide_bound alone gives
    assert later.path == f"batch {batch}: ladder"


def test_before_any_batch_size_is_known_the_route_keeps_its_ladder() -> None:
    """No record knows its batch size yet: the route keeps what it asked for, and its
    session requests take ``hashBalanceFactor`` (the same twin on either path)."""
    nothing = decide(None, None)
    assert nothing.ladder is True and nothing.factor == USUAL and nothing.batch is None
    assert nothing.path == "batch unknown: ladder"


def test_stale_telemetry_keeps_the_path_the_last_known_batch_chose() -> None:
    """Telemetry gone (an agent restarting): no change of clusters, only of the bound, which
    goes to the usual one on either path."""
    small = decide(decide(None, (7, 8)), None, now=NOW + 1)
    assert small.ladder is False and small.saturated is False and small.factor == 0
    assert (
        small.batch == 8 and small.path == "batch 8 (last known): ladder needs > 16; fixed bounds"
    )
    large = decide(decide(None, (8, 32)), None, now=NOW + 1)
    assert large.ladder is True and large.factor == USUAL and large.batch == 32


def test_a_change_of_path_starts_the_other_path_afresh() -> None:
    """A fleet whose batch size changes (replicas replaced by larger ones): the ladder
    starts at its first-record rung, not from the fixed path's state, and back."""
    small = decide(None, (7, 8))
    assert small.saturated is True
    large = decide(small, (8, 32), now=NOW + 1)
    assert large.ladder is True and large.factor == 200 and large.since == NOW + 1  # 329%
    back = decide(large, (2, 8), now=NOW + 2)
    assert back.ladder is False and back.saturated is False and back.since == -math.inf
    assert back != large  # the path changes the route's clusters, so it counts in equality


def test_without_a_saturated_bound_the_small_route_is_always_calm() -> None:
    """``saturatedHashBalanceFactor: 0``: the fixed path is one bound, never saturated."""
    decision = decide(None, (8, 8), saturated_at=None)
    assert decision.ladder is False and decision.saturated is False and decision.fill == 1.0


def test_a_saturated_small_route_calms_when_its_dwell_ends() -> None:
    """The fixed path's rebuild time (``calm_at``) is the fixed bounds' own."""
    saturated = decide(None, (7, 8))
    calm_fill = decide(saturated, (3, 8), now=NOW + 1)
    assert calm_fill.saturated is True and calm_fill.calm_at == NOW + MIN_DWELL
    assert decide(calm_fill, (3, 8), now=calm_fill.calm_at).saturated is False


@pytest.mark.parametrize(
    ("ladder", "batch", "known", "text"),
    [
        pytest.param(False, 8.0, True, "batch 8: ladder needs > 16; fixed bounds", id="8"),
        pytest.param(True, 32.0, True, "batch 32: ladder", id="32"),
        pytest.param(True, 20.5, True, "batch 20.5: ladder", id="a mean of mixed batches"),
        pytest.param(True, None, False, "batch unknown: ladder", id="unknown"),
        pytest.param(
            False, 8.0, False, "batch 8 (last known): ladder needs > 16; fixed bounds", id="stale"
        ),
    ],
)
def test_the_status_says_which_path_and_why(
    ladder: bool, batch: float | None, known: bool, text: str
) -> None:
    assert path_reason(ladder, batch, known=known) == text
