"""A rollout that takes a canary fleet first, end to end: two fleets of one real Envoy each, the
canary fleet's Envoy sending traffic to the canary pool while the other fleet's still sends
none there, then both advancing; each stage judged on its own fleets' access logs."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from harness.rollouts import Traffic, create, rollout, start_rig, step_events
from harness.wait import wait_until

pytestmark = pytest.mark.e2e


def test_a_canary_fleet_takes_each_step_before_the_other_fleet(
    etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, backends: Any
) -> None:
    rig = start_rig(etcd_prefix, kvpilot_factory, envoy_factory, backends, replicas=1)
    blue, green = rig.envoys  # fleets "blue" and "green"
    traffic = Traffic(rig.url).start()
    body = rollout("fleets", min_duration=3, min_sample=10, steps=(50, 100))
    body["spec"]["fleets"] = ["blue"]
    # Long enough for the test to look at both Envoys while step 0 holds in blue alone.
    body["spec"]["steps"][0]["minDuration"] = 10
    try:
        create(rig, body)
        wait_until(
            lambda: rig.canary_share(blue) == 50,
            30,
            message="the canary fleet's Envoy at 50% canary",
        )
        # While the step holds in blue only, blue's Envoy sends traffic to the canary and
        # green's sends it none: green has no canary host at all at weight 0.
        sent = rig.canary_requests(blue)
        wait_until(
            lambda: rig.canary_requests(blue) >= sent + 10,
            30,
            message="traffic through the canary fleet's Envoy to the canary",
        )
        status = rig.status("fleets")
        assert status["step"] == 0 and status["fleets"] == ["blue"], status
        assert rig.canary_share(green) == 0
        assert rig.canary_requests(green) == 0

        wait_until(
            lambda: rig.canary_share(green) == 50,
            60,
            message="the other fleet's Envoy to follow at 50%",
        )
        status = rig.wait_phase("fleets", ["Succeeded", "RolledBack", "Paused"])
        wait_until(lambda: rig.canary_shares() == {100}, 10, message="both Envoys at 100%")
    finally:
        traffic.stop()
    assert status["phase"] == "Succeeded", status
    stages = [
        (e["event"], e["step"], e.get("fleets"))
        for e in status["history"]
        if e["event"] in ("step", "widen")
    ]
    assert stages == [
        ("step", 0, ["blue"]),
        ("widen", 0, None),
        ("step", 1, ["blue"]),
        ("widen", 1, None),
    ], stages
    # Each stage was held for its minimum and judged on a sample of its own.
    times = [e["at"] for e in status["history"] if e["event"] in ("step", "widen", "succeeded")]
    assert all(b - a >= 3 for a, b in itertools.pairwise(times)), times
    verdicts = [e for e in status["history"] if e["event"] == "verdict"]
    assert len(verdicts) == 4, verdicts
    assert all(v["canary"]["requests"] >= 10 for v in verdicts), verdicts
    assert [e["fleets"] for e in verdicts if "fleets" in e] == [["blue"], ["blue"]]
    assert [e["step"] for e in step_events(status)] == [0, 1]
    assert rig.tier_weights() == {"stable": 0, "canary": 100}
    assert all(s == 200 for _, _, s, _ in traffic.records)
