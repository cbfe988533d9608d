"""Failover proven with real traffic through Envoy: a killed tier fails over without failed
requests (between requests and under concurrent load) and comes back, a tier answering 429 is
left for the next one, and outlier detection ejects a replica that answers 5xx while its health
check passes. One kvpilot and one Envoy per test (`rig`).
"""

from __future__ import annotations

import collections
import re
import time
from typing import Any

import httpx
import pytest
from harness.builders import FAST_HEALTH_CHECK, policy, pool
from harness.rig import Rig, ports_of
from harness.traffic import Traffic, send
from harness.wait import wait_until

from controlplane.local import free_port

pytestmark = pytest.mark.e2e
WORKERS = 4
"""Clients of the kill test, each with one request in flight at a time."""


TWO_TIERS = [{"name": "all", "tiers": [["primary"], ["secondary"]]}]


def test_killed_tier_fails_over_without_failed_requests_and_comes_back(
    rig: Rig, backends: Any
) -> None:
    # Fixed ports, so the primary replicas come back where Envoy expects them.
    primary = backends(2, id_prefix="primary", ports=[free_port(), free_port()])
    secondary = backends(1, id_prefix="secondary")
    # Health checks notice a dead replica after three failed probes a second apart, so the
    # first requests after the kill meet dead hosts and only retries save them.
    slow_checks = {"interval": "1s", "unhealthyThreshold": 3}
    rig.apply(
        pool("primary", ports_of(primary), healthCheck=slow_checks, health_check=FAST_HEALTH_CHECK),
        pool("secondary", ports_of(secondary), health_check=FAST_HEALTH_CHECK),
        policy("chat", rig.listener_port, TWO_TIERS),
    )
    rig.wait_ready("chat/all", ports_of(primary) + ports_of(secondary))
    url = rig.url()
    with httpx.Client(timeout=30) as client:
        before = send(client, url, 10)
        assert {replica for _, replica in before} <= {r.id for r in primary.replicas}, before

        primary.kill()
        during = send(client, url, 20)
        assert during == [(200, "secondary-0")] * 20
        rig.wait_down("chat/all", ports_of(primary), 30)
        assert send(client, url, 10) == [(200, "secondary-0")] * 10
        retried = rig.envoy.stats().get("cluster.chat/all.upstream_rq_retry_success", 0)
        assert int(retried) > 0, "no request met a dead replica before health checks noticed"

        primary.start()
        recovered: list[tuple[int, str]] = []

        def back_on_primary() -> bool:
            batch = send(client, url, 10)
            recovered.extend(batch)
            return all(replica.startswith("primary-") for _, replica in batch)

        wait_until(back_on_primary, 30, message="traffic to return to the recovered tier")
    assert all(status == 200 for status, _ in recovered), recovered


def settled(records: list[Any], kill_time: float) -> list[tuple[int, str]]:
    """The answers that finished 2 s or more after the kill (past the window in which a cut
    connection is allowed), in order of completion."""
    return [(status, by) for at, _, status, by in list(records) if at - kill_time >= 2.0]


def rejected(process: Any, replica_id: str, status: int) -> int:
    """How many inference requests a bench replica answered with `status`."""
    text = httpx.get(f"{process.replica(replica_id).url}/metrics", timeout=5).text
    pattern = (
        rf'kvpilot_backend_requests_total{{backend="{replica_id}",'
        rf'path="/v1/chat/completions",status="{status}"}} (\d+)'
    )
    match = re.search(pattern, text)
    return int(match.group(1)) if match else 0


def test_a_tier_answering_429_is_left_for_the_next_tier(rig: Rig, backends: Any) -> None:
    primary = backends(1, id_prefix="primary")
    secondary = backends(1, id_prefix="secondary")
    rig.apply(
        pool("primary", ports_of(primary), health_check=FAST_HEALTH_CHECK),
        pool("secondary", ports_of(secondary), health_check=FAST_HEALTH_CHECK),
        policy("chat", rig.listener_port, TWO_TIERS),
    )
    rig.wait_ready("chat/all", ports_of(primary) + ports_of(secondary))
    with httpx.Client(timeout=30) as client:
        assert send(client, rig.url(), 5) == [(200, "primary-0")] * 5
        primary.fail("primary-0", 429)
        # A 429 is no health failure: the replica stays in priority 0, and each request is
        # retried at priority 1 (previous_priorities), after exactly one try at priority 0.
        assert send(client, rig.url(), 20) == [(200, "secondary-0")] * 20
    assert rejected(primary, "primary-0", 429) == 20


def test_a_tier_killed_under_concurrent_load_fails_no_request_it_could_retry(
    rig: Rig, backends: Any
) -> None:
    primary = backends(2, id_prefix="primary")
    secondary = backends(1, id_prefix="secondary")
    rig.apply(
        pool(
            "primary",
            ports_of(primary),
            healthCheck={"interval": "1s", "unhealthyThreshold": 3},
            health_check=FAST_HEALTH_CHECK,
        ),
        pool("secondary", ports_of(secondary), health_check=FAST_HEALTH_CHECK),
        policy("chat", rig.listener_port, TWO_TIERS),
    )
    rig.wait_ready("chat/all", ports_of(primary) + ports_of(secondary))
    with Traffic(rig.url(), workers=WORKERS) as traffic:
        traffic.wait_for(40)
        # SIGKILL while four clients keep requests in flight: requests already sent to a
        # primary replica are reset, new ones meet refused connections until health checks
        # (three probes a second apart) take the replicas out.
        kill_time = time.time()
        primary.kill()
        killed_at = traffic.finished()
        rig.wait_down("chat/all", ports_of(primary), 60)
        traffic.wait_for(traffic.finished() + 40)
        # Twenty answers finished past the kill's 2 s (a fast failover can finish forty
        # requests sooner, beside one cut at the kill that finishes late).
        wait_until(
            lambda: len(settled(traffic.records, kill_time)) >= 20,
            60,
            message="twenty answers 2 s after the kill",
        )
    results = traffic.results
    # Envoy retries a request whose replica died before answering. One whose answer had begun
    # when the replica died cannot be retried by any proxy: its client sees the connection
    # cut. Those are the only failures allowed, at most one per client, at the kill itself.
    # Every other request answers 200; an HTTP error (a 503 from retries that gave up) or a
    # cut connection later on fails the test.
    cut = [(at, by) for at, _, status, by in traffic.records if status == 0]
    assert all(status in (0, 200) for status, _ in results), collections.Counter(results)
    assert len(cut) <= WORKERS and all(at - kill_time < 2.0 for at, _ in cut), cut
    assert {replica for _, replica in results[:killed_at]} <= {r.id for r in primary.replicas}
    after = settled(traffic.records, kill_time)
    assert len(after) >= 20 and set(after) == {(200, "secondary-0")}, collections.Counter(after)
    retried = rig.envoy.stats().get("cluster.chat/all.upstream_rq_retry_success", 0)
    assert int(retried) > 0, "no request met a dead replica: the kill came after the traffic"


def test_outlier_detection_ejects_a_replica_answering_5xx_while_its_health_check_passes(
    rig: Rig, backends: Any
) -> None:
    replicas = backends(3, id_prefix="llm")
    # A long ejection, so it cannot end while the test looks at it on a loaded machine.
    rig.apply(
        pool(
            "llm",
            ports_of(replicas),
            outlierDetection={"baseEjectionTime": "300s"},
            health_check=FAST_HEALTH_CHECK,
        ),
        policy("chat", rig.listener_port, [{"name": "all", "tiers": [["llm"]]}]),
    )
    rig.wait_ready("chat/all", ports_of(replicas))
    broken = replicas.replicas[0]
    replicas.fail(broken.id, 500)  # inference answers 500; /health still answers 200
    with httpx.Client(timeout=30) as client:

        def ejected() -> bool:
            # Retries hide the 500s from clients; the outlier detector still counts each.
            send(client, rig.url(), 5)
            return "failed_outlier_check" in rig.hosts("chat/all")[broken.port]["health_flags"]

        wait_until(ejected, 60, message="Envoy to eject the replica answering 500")
        flags = rig.hosts("chat/all")[broken.port]["health_flags"]
        assert "failed_active_hc" not in flags, flags
        answered = rejected(replicas, broken.id, 500)
        after = send(client, rig.url(), 30)
    assert {status for status, _ in after} == {200}, after
    assert broken.id not in {replica for _, replica in after}, after
    assert rejected(replicas, broken.id, 500) == answered, "an ejected replica got requests"
