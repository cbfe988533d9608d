"""Service classes through a real Envoy: a saturated pool sheds batch with an OpenAI-format
429 and Retry-After while interactive requests pass, takes batch back when it recovers, and
keeps one tenant's burst within its share of the class budget.

Telemetry is written straight into etcd, as an agent writes it, so that the test decides
exactly when the pool is saturated; everything after etcd is the real path (kvpilot
compiles admission, pushes RDS, Envoy sheds per request).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from harness.agent import agent_running
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool, service_classes
from harness.rig import Rig
from harness.traffic import send
from harness.wait import wait_until

from controlplane.etcd import EtcdClient
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd
from replicasim.simulator import SimConfig

pytestmark = pytest.mark.e2e

CLUSTER = "svc/chat"
BATCH = {"x-priority": "batch"}
STANDARD = {"x-priority": "standard"}
SPILL_ROUTE = {
    "name": "spill",
    "match": {"headers": [{"name": "x-spill", "value": "1"}]},
    "tiers": [["spill"]],
}


def classes(*middle: dict[str, Any], **batch: Any) -> dict[str, Any]:
    """Interactive (the default, never restricted), then `middle`, then batch."""
    # One step restricts a whole class; a fast cadence keeps the test short.
    saturation = {"step": 100, "shedInterval": "200ms", "recoverInterval": "1s"}
    return {
        "tenantHeader": "x-tenant-id",
        **service_classes(*middle, saturation=saturation, **batch),
    }


def classified(
    rig: Rig, service_classes: dict[str, Any], *routes: dict[str, Any]
) -> dict[str, Any]:
    """Policy `svc`: `routes`, then route `chat` to pool `sims`, with these classes."""
    body = policy("svc", rig.listener_port, [*routes, {"name": "chat", "tiers": [["sims"]]}])
    body["spec"]["serviceClasses"] = service_classes
    return body


def put_telemetry(etcd: EmbeddedEtcd, prefix: str, ports: list[int], waiting: float) -> None:
    """Every replica's record, as `kvpilot agent` would write it."""

    async def put() -> None:
        client = EtcdClient([etcd.endpoint])
        await client.connect()
        try:
            store = Store(client, prefix)
            for port in ports:
                record = {"at": time.time(), "waiting": waiting, "running": 4, "kv_cache": 0.3}
                await store.put_telemetry("sims", f"127.0.0.1:{port}", record)
        finally:
            await client.close()

    asyncio.run(put())


def status(client: httpx.Client, rig: Rig, headers: dict[str, str] | None = None) -> int:
    return client.post(rig.url(), json=chat(), headers=headers or {}).status_code


def test_a_saturated_pool_sheds_batch_first_and_takes_it_back_when_it_recovers(
    rig: Rig, backends: Any, etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    replicas = backends(2, id_prefix="svc")
    ports = [r.port for r in replicas.replicas]
    own = {r.id for r in replicas.replicas}
    spill = backends(1, id_prefix="spill")
    standard = {
        "name": "standard",
        "match": {"headers": [{"name": "x-priority", "value": "standard"}]},
        "objective": {"ttft": "5s"},
        "whenSaturated": "divert",
        "divertTo": "spill",
    }
    rig.apply(
        pool("sims", ports, telemetry={"maxAge": "60s"}, health_check=FAST_HEALTH_CHECK),
        pool("spill", [spill.replicas[0].port], health_check=FAST_HEALTH_CHECK),
        classified(rig, classes(standard, whenSaturated="shed", retryAfter="7s"), SPILL_ROUTE),
    )
    rig.wait_ready(CLUSTER, ports)
    client = httpx.Client(timeout=10)
    put_telemetry(etcd, etcd_prefix, ports, waiting=0)

    # The fleet has room: nothing is shed or diverted.
    wait_until(lambda: status(client, rig, BATCH) == 200, 30, message="batch served")
    assert [status(client, rig, BATCH) for _ in range(10)] == [200] * 10
    assert {replica for _, replica in send(client, rig.url(), 5, headers=STANDARD)} <= own

    # Saturated (mean queue 20 against a bound of 4): batch is shed, interactive passes.
    before = rig.envoy.stats()
    saturated_at = time.monotonic()
    put_telemetry(etcd, etcd_prefix, ports, waiting=20)
    wait_until(lambda: status(client, rig, BATCH) == 429, 30, message="batch to be shed")
    took = time.monotonic() - saturated_at
    shed = client.post(rig.url(), json=chat(), headers=BATCH)
    assert shed.status_code == 429
    assert shed.headers["retry-after"] == "7"
    assert shed.headers["content-type"] == "application/json"
    assert "x-backend-id" not in shed.headers  # Envoy answered, no replica was asked
    error = shed.json()["error"]
    assert error["code"] == "overloaded"
    assert error["type"] == "rate_limit_exceeded"
    assert "'batch'" in error["message"] and "7 seconds" in error["message"]
    assert [status(client, rig, BATCH) for _ in range(10)] == [429] * 10
    assert [status(client, rig) for _ in range(10)] == [200] * 10
    # The admission decision reached Envoy over RDS alone: no listener or cluster was
    # replaced, so no connection was drained.
    stats = rig.envoy.stats()
    for name in ("listener_manager.listener_modified", "cluster_manager.cluster_modified"):
        assert stats[name] == before[name], name
    shed_count = stats["chat.batch.shed.http_local_rate_limit.enabled"]
    assert isinstance(shed_count, int) and shed_count >= 11
    admitted = stats["vhost.svc.route.chat.interactive.upstream_rq_completed"]
    assert isinstance(admitted, int) and admitted >= 10
    print(f"telemetry write to first shed request: {took:.2f}s")

    # Still saturated: the next class up, standard, is diverted to the spill route's pool.
    spilled = spill.replicas[0].id
    wait_until(
        lambda: send(client, rig.url(), 1, headers=STANDARD)[0][1] == spilled,
        30,
        message="standard to be diverted",
    )
    assert send(client, rig.url(), 5, headers=STANDARD) == [(200, spilled)] * 5
    assert [status(client, rig) for _ in range(5)] == [200] * 5
    diverted = rig.envoy.stats()["vhost.svc.route.chat.standard.diverted.upstream_rq_completed"]
    assert isinstance(diverted, int) and diverted >= 6

    # Recovered: standard comes back first, then batch, a recovery interval apart.
    put_telemetry(etcd, etcd_prefix, ports, waiting=0)
    wait_until(
        lambda: send(client, rig.url(), 1, headers=STANDARD)[0][1] in own,
        30,
        message="standard to be served by its own pool again",
    )
    wait_until(lambda: status(client, rig, BATCH) == 200, 30, message="batch to be readmitted")
    assert [status(client, rig, BATCH) for _ in range(10)] == [200] * 10
    metrics = httpx.get(f"{rig.kvpilot.api_url}/metrics", timeout=5).text
    assert 'kvpilot_admission_changes_total{direction="restrict",route="svc/chat"} 2.0' in metrics
    assert 'kvpilot_admission_changes_total{direction="readmit",route="svc/chat"} 2.0' in metrics


def test_slow_first_tokens_seen_by_the_agent_shed_batch_and_fast_ones_take_it_back(
    rig: Rig, backends: Any, etcd: EmbeddedEtcd, etcd_prefix: str, tmp_path: Any
) -> None:
    """The default saturation signal, closed through the real agent: simulated replicas
    whose engine steps slow down report slow first tokens in vLLM's TTFT histogram, the
    agent writes them, and kvpilot sheds batch with no queue anywhere."""
    replicas = backends(2, id_prefix="ttft", simulator=SimConfig())
    ports = [r.port for r in replicas.replicas]
    service_classes = classes(whenSaturated="shed", retryAfter="5s")
    # Interactive's objective 200 ms: the pool saturates at a mean TTFT of 100 ms. A
    # simulated step takes 12 ms (about 20 ms to a first token), 240 ms when slowed 20x.
    service_classes["classes"][0]["objective"] = {"ttft": "200ms"}
    rig.apply(
        pool("sims", ports, telemetry={"maxAge": "10s"}, health_check=FAST_HEALTH_CHECK),
        classified(rig, service_classes),
    )
    rig.wait_ready(CLUSTER, ports)
    client = httpx.Client(timeout=30)
    short = chat(max_tokens=2)
    stop = threading.Event()

    def chatting() -> None:
        # Interactive traffic keeps both replicas working, so their engines keep
        # reporting first tokens (an idle replica reports none).
        with httpx.Client(timeout=30) as own:
            while not stop.is_set():
                own.post(rig.url(), json=chat(max_tokens=8))

    def batch() -> int:
        return client.post(rig.url(), json=short, headers=BATCH).status_code

    def pressure() -> float:
        text = httpx.get(f"{rig.kvpilot.api_url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith('kvpilot_admission_pressure{route="svc/chat"}'):
                return float(line.rpartition(" ")[2])
        return -1.0

    agent_log = tmp_path / "agent.log"
    urls = [r.url for r in replicas.replicas]
    with (
        agent_running(etcd.endpoint, etcd_prefix, "sims", urls, log=agent_log, refresh=1),
        ThreadPoolExecutor(3) as load,
    ):
        loops = [load.submit(chatting) for _ in range(3)]
        try:
            seen: list[float] = []

            def calm() -> bool:
                seen.append(pressure())
                return 0 <= seen[-1] < 0.5

            try:
                wait_until(calm, 60, message="fast first tokens reported")
            except AssertionError:
                log = agent_log.read_text()[-3000:]
                raise AssertionError(f"pressure {seen[-30:]}; agent: {log}") from None
            assert [batch() for _ in range(5)] == [200] * 5

            for replica in replicas.replicas:
                replicas.slow(replica.id, 20)
            wait_until(lambda: batch() == 429, 30, message="batch shed on slow first tokens")
            assert pressure() >= 1.0
            assert [client.post(rig.url(), json=short).status_code for _ in range(3)] == [200] * 3

            for replica in replicas.replicas:
                replicas.slow(replica.id, 1)
            wait_until(lambda: batch() == 200, 30, message="batch readmitted")
            assert [batch() for _ in range(5)] == [200] * 5
        finally:
            stop.set()
        for loop in loops:
            loop.result()


def test_a_tenant_over_its_share_of_the_class_budget_is_limited_while_others_pass(
    rig: Rig, backends: Any
) -> None:
    replicas = backends(1, id_prefix="fair")
    ports = [r.port for r in replicas.replicas]
    budget = {"requests": 6, "unit": "hour", "tenantShare": 50}
    rig.apply(
        pool("sims", ports, health_check=FAST_HEALTH_CHECK), classified(rig, classes(budget=budget))
    )
    rig.wait_ready(CLUSTER, ports)
    client = httpx.Client(timeout=10)
    # Interactive traffic is outside the batch budget; it proves the config arrived.
    wait_until(lambda: status(client, rig) == 200, 30, message="the route to serve")

    def batch(tenant: str) -> int:
        return status(client, rig, {**BATCH, "x-tenant-id": tenant})

    # Each tenant may take half of the class's 6 requests: the fourth of a bursting tenant
    # is refused, while another tenant still gets its share.
    assert [batch("bursty") for _ in range(5)] == [200, 200, 200, 429, 429]
    assert [batch("steady") for _ in range(3)] == [200, 200, 200]
    limited = client.post(rig.url(), json=chat(), headers={**BATCH, "x-tenant-id": "bursty"})
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    # The class budget is spent: a third tenant is refused too; interactive is not limited.
    assert batch("third") == 429
    assert [status(client, rig) for _ in range(5)] == [200] * 5


def test_a_queued_class_waits_in_envoy_within_its_bounds(
    etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, gated: Any, etcd: EmbeddedEtcd
) -> None:
    kvpilot = kvpilot_factory(etcd_prefix)
    # One worker thread: Envoy lets each worker open a connection even past the limit, so
    # with more workers the concurrency bound is at least their number.
    envoy = envoy_factory(xds_port=kvpilot.xds_port, extra_args=["--concurrency", "1"])
    rig = Rig.around(kvpilot, envoy)
    replica = gated(1, id_prefix="q")
    ports = list(replica.ports.values())
    background = {
        "name": "background",
        "match": {"headers": [{"name": "x-priority", "value": "background"}]},
        "objective": {"ttft": "30s"},
        "whenSaturated": "queue",
        "queue": {"concurrency": 1, "size": 1},
    }
    service_classes = classes(background)
    rig.apply(
        pool("sims", ports, telemetry={"maxAge": "60s"}, health_check=FAST_HEALTH_CHECK),
        classified(rig, service_classes),
    )
    rig.wait_ready(CLUSTER, ports)
    client = httpx.Client(timeout=30)
    wait_until(lambda: status(client, rig) == 200, 30, message="the route to serve")
    put_telemetry(etcd, etcd_prefix, ports, waiting=20)
    wait_until(
        lambda: "@background/queue" in json.dumps(rig.envoy.config_dump()),
        30,
        message="background to be queued in Envoy",
    )
    # One background request at the replica, one waiting in Envoy, the third turned away.
    replica.set_gate(False)
    headers = {"x-priority": "background"}
    with ThreadPoolExecutor(3) as pool_:
        first = pool_.submit(client.post, rig.url(), json=chat(), headers=headers)
        wait_until(lambda: sum(replica.in_flight().values()) == 1, 30, message="one held")
        second = pool_.submit(client.post, rig.url(), json=chat(), headers=headers)
        queue = "cluster.svc/chat/queue/background.upstream_rq_pending_active"
        wait_until(lambda: rig.envoy.stats().get(queue) == 1, 30, message="one waiting")
        overflow = client.post(rig.url(), json=chat(), headers=headers)
        assert overflow.status_code == 503
        assert "overflow" in overflow.json()["error"]["code"]
        assert sum(replica.in_flight().values()) == 1  # the queue held the second one
        replica.set_gate(True)
        assert [first.result().status_code, second.result().status_code] == [200, 200]
