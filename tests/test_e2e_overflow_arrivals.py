"""Overflow by arrivals (``overflow.signal: arrivals``) through a real Envoy and etcd: the
route's Envoy reports each request's start, kvpilot reads the route's demand against the
owned replicas' capacity, and the share above it goes to the paid pool; when the demand
falls, traffic returns to the owned replicas.

The owned replicas are simulated engines (``replicasim``) with two batch slots each that
stream their answers, so their service times and completions are real, read from Envoy's
arrivals log. Their telemetry (batch size, running, waiting) is written into etcd as an
agent writes it, refreshed every half second so kvpilot rebuilds as it would with agents.
The paid pool is a stand-in on ``localhost`` (``test_e2e_overflow``'s), answering at once.
A prefill fit stored in etcd, as a kvpilot that ran before would have left it, is what the
route weighs its work with from the start.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool
from harness.overflow import TRUE_WEIGHT, learned_fit
from harness.paid import overflow_entries, paid_pool, paid_stand_in
from harness.rig import Rig, api_client
from harness.wait import wait_until

from controlplane.etcd import EtcdClient
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd
from controlplane.prefillfits import fit_key
from replicasim.simulator import SimConfig
from signals.prefillrecord import FitScope, fit_record

pytestmark = pytest.mark.e2e

CLUSTER = "paid/chat"
SLOTS = 2
"""Batch slots of each owned replica."""
BODY = chat(max_tokens=60, stream=True)
"""A streamed answer of 60 tokens: about 0.8 s in a simulated batch of two."""


@contextmanager
def telemetry_writer(etcd: EmbeddedEtcd, prefix: str, ports: list[int]) -> Iterator[list[float]]:
    """Write every owned replica's record every 0.5 s, at the batch fill in the list it
    yields (``[fill]``: running is min(fill, 1) x slots, the rest waiting)."""
    fill = [0.3]
    stop = threading.Event()

    async def run() -> None:
        client = EtcdClient([etcd.endpoint])
        await client.connect()
        try:
            store = Store(client, prefix)
            while not stop.is_set():
                running = min(1.0, fill[0]) * SLOTS
                for port in ports:
                    record = {
                        "at": time.time(),
                        "running": running,
                        "waiting": fill[0] * SLOTS - running,
                        "max_running": SLOTS,
                    }
                    await store.put_telemetry("owned", f"127.0.0.1:{port}", record)
                await asyncio.sleep(0.5)
        finally:
            await client.close()

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    try:
        yield fill
    finally:
        stop.set()
        thread.join(10)


@contextmanager
def open_load(rig: Rig, rate: list[float]) -> Iterator[Callable[[], list[str]]]:
    """Send streamed requests at `rate[0]` a second whatever the answers take (an open
    load: arrivals do not wait for completions); yields a function that takes the backends
    that answered since the last call."""
    stop = threading.Event()
    answered: list[str] = []
    lock = threading.Lock()

    def one(client: httpx.Client) -> None:
        with client.stream("POST", rig.url(), json=BODY) as answer:
            answer.read()
            with lock:
                answered.append(
                    answer.headers.get("x-backend-id", "") if answer.status_code == 200 else ""
                )

    def run() -> None:
        with httpx.Client(timeout=30) as client, ThreadPoolExecutor(32) as pool_:
            due = time.monotonic()
            while not stop.is_set():
                pool_.submit(one, client)
                due += 1 / rate[0]
                time.sleep(max(0.0, due - time.monotonic()))

    def taken() -> list[str]:
        with lock:
            out = list(answered)
            answered.clear()
        return out

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield taken
    finally:
        stop.set()
        thread.join(60)


def _extend(into: list[str], more: list[str]) -> list[str]:
    into.extend(more)
    return into


def _reported(rig: Rig) -> dict[str, Any]:
    """The route's overflow status once it reports a demand and a capacity."""
    status: dict[str, Any] = wait_until(
        lambda: (s := overflow_status(rig))["demand"] and s["capacity"] and s,
        30,
        message="demand and capacity reported",
    )
    return status


def _answered_by_owned(
    paid: Any, taken: Callable[[], list[str]], owned: set[str], count: int
) -> int:
    """Once the paid stand-in is idle (requests drawn before the route change may still be
    there), the next `count` answers all come from the owned replicas; the paid stand-in's
    hits when they began."""
    wait_until(lambda: _settled(paid), 10, message="the paid pool idle")
    taken()
    hits = int(paid.hits)
    answered: list[str] = []
    wait_until(lambda: len(_extend(answered, taken())) >= count, 20, message="answers after it")
    assert set(answered) <= owned, answered
    return hits


def _settled(paid: Any) -> bool:
    """No new request reached the paid stand-in over the last half second."""
    before = paid.hits
    time.sleep(0.5)
    return bool(paid.hits == before)


def overflow_status(rig: Rig) -> dict[str, Any]:
    status = api_client(rig.kvpilot).get("/v1/status").json()
    return next(e for e in status["overflow"] if e["route"] == CLUSTER)


@contextmanager
def owned_and_paid(
    rig: Rig,
    backends: Any,
    etcd: EmbeddedEtcd,
    etcd_prefix: str,
    route: dict[str, Any],
) -> Iterator[tuple[set[str], Any, list[float]]]:
    """Two simulated owned replicas whose telemetry this test writes, a paid stand-in and
    `route` over them, ready: yields (the owned replicas' ids, the stand-in, the fill)."""
    replicas = backends(
        2, id_prefix="owned", simulator=SimConfig(max_batch=SLOTS, stream_interval=0.05)
    )
    ports = [r.port for r in replicas.replicas]
    with (
        paid_stand_in("paid") as paid,
        telemetry_writer(etcd, etcd_prefix, ports) as fill,
    ):
        rig.apply(
            pool("owned", ports, telemetry={"maxAge": "10s"}, health_check=FAST_HEALTH_CHECK),
            paid_pool("paid", paid.port),
            policy("paid", rig.listener_port, [route]),
        )
        rig.wait_ready(CLUSTER, ports)
        yield {r.id for r in replicas.replicas}, paid, fill


def store_fit(etcd: EmbeddedEtcd, prefix: str) -> None:
    """Leave the route's prefill fit in etcd as a kvpilot that ran before would have: learned
    on the owned pool at its batch size."""

    async def put() -> None:
        async with EtcdClient([etcd.endpoint]) as client:
            store = Store(client, prefix)
            body = fit_record(learned_fit(), FitScope(("owned",), SLOTS), time.time(), "before")
            await client.put(store.keys.absolute(fit_key(CLUSTER)), json.dumps(body).encode())

    asyncio.run(put())


def test_overflow_by_arrivals_sends_the_excess_to_paid_and_returns_when_demand_falls(
    rig: Rig, backends: Any, etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    store_fit(etcd, etcd_prefix)
    route = {
        "name": "chat",
        "tiers": [["owned"]],
        "sessionAffinity": {"header": "x-session-id"},
        "overflow": {"pools": ["paid"], "signal": "arrivals", "recoverInterval": "2s"},
    }
    with owned_and_paid(rig, backends, etcd, etcd_prefix, route) as (owned, paid, fill):
        rate = [1.0]
        with open_load(rig, rate) as taken:
            # Light: one request a second against four slots; their service times and the
            # route's demand are reported, nothing goes to the paid pool.
            light = _reported(rig)
            assert light["signal"] == "arrivals" and not light["capacityMeasured"]
            assert light["demand"] == pytest.approx(1.0, rel=0.5)
            assert light["paidShare"] == 0.0 and "within" in light["why"], light
            # The route weighs a prefilled token with the stored fit, not the constant.
            assert light["prefillWeightSource"] == "stored", light
            assert light["prefillWeight"] == pytest.approx(TRUE_WEIGHT, abs=1e-3)
            metrics = api_client(rig.kvpilot).get("/metrics").text
            assert (
                'kvpilot_overflow_prefill_weight{route="paid/chat",source="stored"} '
                f"{light['prefillWeight']}"
            ) in metrics
            assert set(taken()) <= owned and paid.hits == 0
            assert overflow_entries(rig) == {}

            # Six a second, well above what four slots serve at 0.8 s each (5/s): the
            # replicas' batches fill and the share above their capacity goes to paid.
            fill[0] = 2.0
            rate[0] = 6.0
            saturated_at = time.monotonic()
            wait_until(lambda: overflow_entries(rig) != {}, 30, message="overflow to paid")
            took = time.monotonic() - saturated_at
            hits = paid.hits
            wait_until(lambda: paid.hits > hits + 10, 20, message="requests on the paid pool")
            peak = overflow_status(rig)
            assert peak["paidShare"] > 0.05 and "above" in peak["why"], peak
            assert peak["provider"] == "paid" and peak["requests"] > 0
            # The owned replicas keep serving their part.
            assert owned & set(taken())

            # The load falls back to one a second and the batches have room: the share
            # comes back and traffic returns to the owned replicas.
            rate[0] = 1.0
            fill[0] = 0.3
            calm_at = time.monotonic()
            wait_until(lambda: overflow_entries(rig) == {}, 40, message="the overflow to end")
            returned = time.monotonic() - calm_at
            back = overflow_status(rig)
            assert back["paidShare"] == 0.0 and back["requests"] == 0.0, back
            hits = _answered_by_owned(paid, taken, owned, 4)
            assert paid.hits == hits
            print(
                f"overflow began {took:.2f} s after the load rose, ended {returned:.2f} s after "
                f"it fell; at the peak {peak}"
            )


def test_a_queue_beyond_the_objective_is_drained_to_paid_and_the_share_returns(
    rig: Rig, backends: Any, etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    route = {
        "name": "chat",
        "tiers": [["owned"]],
        "overflow": {
            "pools": ["paid"],
            "signal": "arrivals",
            "ttft": "1s",
            "recoverInterval": "2s",
        },
    }
    with owned_and_paid(rig, backends, etcd, etcd_prefix, route) as (owned, paid, fill):
        rate = [1.0]
        with open_load(rig, rate) as taken:
            calm = _reported(rig)
            assert calm["paidShare"] == 0.0 and calm["drain"] == 0.0, calm
            assert set(taken()) <= owned and paid.hits == 0
            # The demand stays within capacity, but the replicas report 18 waiting each:
            # far beyond the queue a 1 s objective allows, so it is drained to paid.
            fill[0] = 10.0
            drained = wait_until(
                lambda: (s := overflow_status(rig))["drain"] > 0 and s,
                30,
                message="a drain of the queue",
            )
            assert drained["queued"] == pytest.approx(36.0), drained
            assert "within" in drained["why"] and "to drain it" in drained["why"], drained
            wait_until(lambda: overflow_entries(rig) != {}, 30, message="overflow to paid")
            hits = paid.hits
            wait_until(lambda: paid.hits > hits + 3, 20, message="requests on the paid pool")
            # The queue is served: the share comes back and the owned replicas take it all.
            fill[0] = 0.3
            wait_until(lambda: overflow_entries(rig) == {}, 40, message="the overflow to end")
            back = overflow_status(rig)
            assert back["paidShare"] == 0.0 and back["drain"] == 0.0, back
            _answered_by_owned(paid, taken, owned, 3)
