"""The gate's price probe (`bench.cost.gateprice`): the gated side's plan has the gate and
the direct side's does not, and a tiny run through two real Envoys answers on both sides.
No timing asserts: the numbers are the probe's to report."""

from __future__ import annotations

from bench.cost.gateprice import SIDES, gate_fleet, measure


def test_only_the_gated_side_has_a_gate() -> None:
    gated = gate_fleet(10000, 8000, gated=True)
    direct = gate_fleet(10000, 8000, gated=False)
    assert [c.name for c in gated.clusters if c.kind == "gate"] == ["main/small/gate"]
    assert not [c for c in direct.clusters if c.kind == "gate"]
    # The same route otherwise: the gate's clusters are all that is added.
    assert {c.name for c in direct.clusters} < {c.name for c in gated.clusters}


def test_a_tiny_run_answers_on_both_sides() -> None:
    results = measure(8)
    assert set(results) == {"JSON", "streamed"}
    for timings in results.values():
        assert set(timings) == set(SIDES)
        for side in SIDES:
            assert 0 < timings[side]["median_ms"] <= timings[side]["p99_ms"]
            assert timings[side]["cpu_us_per_request"] >= 0
