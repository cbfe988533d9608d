"""The gate (``overflow.maxInFlight``) through a real Envoy: requests reach the owned
replicas through an internal listener whose circuit breaker takes `LIMIT` at a time; a
request without a session that finds them all taken is answered by the paid pool in the
same request, and a conversation's turn waits on its replica instead. No share is set
(``signal: fill`` without telemetry sends nothing to paid), so the gate alone moves them.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool
from harness.paid import paid_pool, paid_stand_in, put_fill
from harness.rig import Rig
from harness.spend import pool_rows
from harness.wait import wait_until

from compiler.gate import GATE_OPEN
from controlplane.local import EmbeddedEtcd
from replicasim.simulator import SimConfig
from xdsserver.translate.metadata import GATE_UPSTREAM

pytestmark = pytest.mark.e2e

CLUSTER = "paid/chat"
SLOTS = 2
"""Batch slots of each owned replica (two replicas)."""
LIMIT = 4
"""The gate: the owned replicas' batch slots, for this one Envoy."""
BODY = chat(max_tokens=60, stream=True)
"""A streamed answer of 60 tokens: about 0.8 s in a simulated batch of two."""
LONG = chat(max_tokens=240, stream=True)
"""Four times as long: a burst of them is in flight together however slowly its threads
start on a loaded machine."""


def _burst(
    rig: Rig, count: int, session: str | None = None, body: dict[str, Any] = BODY
) -> list[tuple[int, str]]:
    """`count` requests at once; (status, backend) of each."""
    headers = {"x-session-id": session} if session else {}

    def one(client: httpx.Client) -> tuple[int, str]:
        with client.stream("POST", rig.url(), json=body, headers=headers) as answer:
            answer.read()
            # The gate names the replica for the usage log alone.
            assert GATE_UPSTREAM not in answer.headers, answer.headers
            return answer.status_code, answer.headers.get("x-backend-id", "")

    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(count) as threads:
        return list(threads.map(lambda _: one(client), range(count)))


def _extend(into: list[tuple[int, str]], more: list[tuple[int, str]]) -> list[tuple[int, str]]:
    into.extend(more)
    return into


def _stat(rig: Rig, name: str) -> int:
    text = httpx.get(f"{rig.envoy.admin_url}/stats", params={"filter": name}).text
    return sum(int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.strip())


def test_the_gate_sends_the_excess_of_the_moment_to_paid_and_keeps_conversations(
    rig: Rig, backends: Any
) -> None:
    replicas = backends(
        2, id_prefix="owned", simulator=SimConfig(max_batch=SLOTS, stream_interval=0.05)
    )
    ports = [r.port for r in replicas.replicas]
    owned = {r.id for r in replicas.replicas}
    route = {
        "name": "chat",
        "tiers": [["owned"]],
        "sessionAffinity": {"header": "x-session-id"},
        "overflow": {"pools": ["paid"], "signal": "fill", "maxInFlight": LIMIT},
    }
    with paid_stand_in("paid") as paid:
        rig.apply(
            pool("owned", ports, health_check=FAST_HEALTH_CHECK),
            paid_pool("paid", paid.port),
            policy("paid", rig.listener_port, [route]),
        )
        rig.wait_ready(CLUSTER, ports)
        status = rig.api.get("/v1/status").json()
        overflow = next(e for e in status["overflow"] if e["route"] == CLUSTER)
        assert overflow["gate"] == {"maxInFlight": LIMIT}, overflow
        sent: list[tuple[int, str]] = []
        wait_until(
            lambda: all(status == 200 for status, _ in _extend(sent, _burst(rig, 1))),
            30,
            message="gate ready",
        )
        paid.hits = 0

        # One request at a time: the owned replicas take them all.
        alone = _extend(sent, [_burst(rig, 1)[0] for _ in range(3)])[-3:]
        assert all(status == 200 and backend in owned for status, backend in alone), alone
        assert paid.hits == 0

        # Ten at once: the gate lets LIMIT through, the rest are answered by paid at once.
        answers = _extend(sent, _burst(rig, 10, body=LONG))[-10:]
        assert all(status == 200 for status, _ in answers), answers
        by_owned = sum(backend in owned for _, backend in answers)
        by_paid = sum(backend == "paid" for _, backend in answers)
        assert (by_owned, by_paid) == (LIMIT, 10 - LIMIT), answers
        assert (
            _stat(rig, "cluster.paid/chat/gate/replicas.upstream_rq_active_overflow") >= 10 - LIMIT
        )
        # Spend is counted by the pool that answered: the owned replicas' behind the gate,
        # every one of their answers (the paid stand-in sends no usage).
        answered = sum(status == 200 and backend in owned for status, backend in sent)
        wait_until(
            lambda: pool_rows(rig).get("owned", Counter())["requests"] == answered,
            30,
            message=f"the owned replicas' {answered} answers counted",
        )
        assert set(pool_rows(rig)) == {"owned"}, pool_rows(rig)

        # A conversation's turns one at a time keep its replica.
        hits = paid.hits
        alone = [_burst(rig, 1, session="conversation-1")[0] for _ in range(3)]
        assert all(status == 200 for status, _ in alone), alone
        assert len({backend for _, backend in alone}) == 1 and alone[0][1] in owned, alone
        # Ten turns of it at once: none goes to paid. (Behind the gate no replica holds more
        # than the mean of what it lets in, so the other replica may take some; those the
        # gate turns away wait on the conversation's own.)
        turns = _burst(rig, 10, session="conversation-1")
        assert all(status == 200 and backend in owned for status, backend in turns), turns
        assert paid.hits == hits


def _gate_limit(envoy: Any) -> int | None:
    """The breaker behind the gate in `envoy`'s running config: max_requests, or None."""
    dump = httpx.get(
        f"{envoy.admin_url}/config_dump", params={"resource": "dynamic_active_clusters"}
    )
    for entry in dump.json().get("configs", []):
        cluster = entry.get("cluster", {})
        if cluster.get("name") == f"{CLUSTER}/gate/replicas":
            thresholds = cluster.get("circuit_breakers", {}).get("thresholds", [{}])
            return int(thresholds[0].get("max_requests", 0))
    return None


def test_an_auto_gate_splits_the_reported_batch_slots_over_the_fleets_envoys(
    rig: Rig,
    backends: Any,
    etcd: EmbeddedEtcd,
    etcd_prefix: str,
    envoy_factory: Any,
) -> None:
    """``maxInFlight: auto``: an open gate before a batch size is known; then 90% of the slots
    the agents report over the Envoys connected in the fleet, following a second Envoy that
    joins and leaves; and the paid pool answering once every owned replica is gone."""
    replicas = backends(2, id_prefix="owned")
    ports = [r.port for r in replicas.replicas]
    route = {
        "name": "chat",
        "tiers": [["owned"]],
        "overflow": {"pools": ["paid"], "signal": "fill", "maxInFlight": "auto"},
    }
    with paid_stand_in("paid") as paid:
        rig.apply(
            pool("owned", ports, telemetry={"maxAge": "300s"}, health_check=FAST_HEALTH_CHECK),
            paid_pool("paid", paid.port),
            policy("paid", rig.listener_port, [route]),
        )
        rig.wait_ready(CLUSTER, ports)
        # No batch size yet: a gate that turns nothing away.
        wait_until(lambda: _gate_limit(rig.envoy) == GATE_OPEN, 30, message="the open gate")
        overflow = next(e for e in rig.api.get("/v1/status").json()["overflow"])
        assert overflow["gate"] == {"maxInFlight": GATE_OPEN}, overflow
        assert overflow["gateAuto"]["batchSlots"] == 0, overflow

        # Two replicas of 16 slots, one Envoy: 90% of 32.
        put_fill(etcd, etcd_prefix, ports, 0.2, slots=16)
        wait_until(lambda: _gate_limit(rig.envoy) == 28, 30, message="the gate at 28")
        overflow = next(e for e in rig.api.get("/v1/status").json()["overflow"])
        assert overflow["gate"] == {"maxInFlight": 28}, overflow
        assert overflow["gateAuto"] == {"batchSlots": 32, "envoys": 1}, overflow

        # A second Envoy of the fleet: each gets half.
        second = envoy_factory(xds_port=rig.kvpilot.xds_port, fleet="default")
        wait_until(lambda: _gate_limit(rig.envoy) == 14, 30, message="the first gate at 14")
        wait_until(lambda: _gate_limit(second) == 14, 30, message="the second gate at 14")
        second.stop()
        wait_until(lambda: _gate_limit(rig.envoy) == 28, 30, message="the gate back at 28")
        # Requests pass the gate to the owned replicas.
        owned = {r.id for r in replicas.replicas}
        answers = _burst(rig, 3)
        assert all(status == 200 and backend in owned for status, backend in answers), answers
        assert paid.hits == 0

        # Every owned replica gone (their records not yet stale: the gate holds 28): Envoy's
        # health checks leave the gate's cluster no healthy host, and its 503 is retried on
        # the paid pool.
        replicas.stop()
        wait_until(
            lambda: all(answer == (200, "paid") for answer in _burst(rig, 3)),
            30,
            message="the paid pool answering",
        )
