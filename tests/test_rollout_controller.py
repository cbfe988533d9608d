"""The rollout controller against a real etcd, without Envoy: one driver at a time, fenced
writes, steps held for their minimum, and a rollout whose policy disappears."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from time import monotonic as loop_time
from typing import Any

import pytest
from harness.builders import policy, pool, rollout, rollout_steps
from harness.wait import poll

from controlplane.election import leader_key
from controlplane.etcd import EtcdClient
from controlplane.etcd.keys import decode_json
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd
from controlplane.mirror import StateMirror
from controlplane.rollouts.controller import RolloutController
from controlplane.rollouts.state import LEADER_JOB, state_key

pytestmark = pytest.mark.e2e


def stepping_rollout(min_duration: float = 0.3) -> dict[str, Any]:
    """Rollout `r` of `next` in steps of 20, 60 and 100%; with no rules every step passes once
    held for its minimum."""
    return rollout("r", steps=rollout_steps((20, 60, 100), min_duration), analysis={"rules": []})


@contextlib.asynccontextmanager
async def controller(
    endpoint: str, prefix: str, replica: str
) -> AsyncIterator[tuple[RolloutController, Store]]:
    client = EtcdClient([endpoint])
    await client.connect()
    mirror = StateMirror(client, prefix)
    watch = asyncio.create_task(mirror.run())
    await mirror.wait_synced(10)
    store = Store(client, prefix)
    driver = RolloutController(
        client, store.keys, lambda: mirror.items, replica, lease_ttl=2, tick=0.05
    )
    task = asyncio.create_task(driver.run())
    try:
        yield driver, store
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        watch.cancel()
        await client.close()
        await asyncio.gather(watch, return_exceptions=True)


async def state(store: Store) -> dict[str, Any]:
    kv = await store.client.get(store.keys.absolute(state_key("r")))
    return (decode_json(kv) if kv is not None else None) or {}


async def test_one_driver_steps_through_holding_each_step(
    etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    async with (
        controller(etcd.endpoint, etcd_prefix, "a") as (a, store),
        controller(etcd.endpoint, etcd_prefix, "b") as (b, _),
    ):
        for body in (pool("chat"), pool("next", [8003]), policy("main", pools=("chat",))):
            await store.create(body["kind"], body["metadata"]["name"], body)
        await poll(lambda: a.leading or b.leading, within=10)
        assert a.leading != b.leading
        await store.create("Rollout", "r", stepping_rollout())

        async def succeeded() -> bool:
            return (await state(store)).get("phase") == "Succeeded"

        await poll(succeeded, within=20)
        record = await state(store)
        steps = [e for e in record["history"] if e["event"] == "step"]
        assert [e["weights"]["next"] for e in steps] == [20, 60, 100]
        assert {e["by"] for e in record["history"]} == {"a" if a.leading else "b"}
        assert all(y["at"] - x["at"] >= 0.3 for x, y in itertools.pairwise(steps)), [
            (y["at"] - x["at"], x["at"], y["at"]) for x, y in itertools.pairwise(steps)
        ]
        stored = await store.get("RoutingPolicy", "main")
        assert stored is not None
        tier = stored.body["spec"]["routes"][0]["tiers"][0]["pools"]
        assert {t["pool"]: t["weight"] for t in tier} == {"chat": 0, "next": 100}


async def test_a_stale_leader_cannot_write_and_a_lost_policy_fails_the_rollout(
    etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    async with controller(etcd.endpoint, etcd_prefix, "a") as (a, store):
        for body in (pool("chat"), pool("next", [8003]), policy("main", pools=("chat",))):
            await store.create(body["kind"], body["metadata"]["name"], body)
        await poll(lambda: a.leading, within=10)
        # Someone else takes the leader key (as a successor would after a lease expiry):
        # the old leader's fenced writes fail and it steps down.
        leadership = a.election.leadership
        assert leadership is not None
        await store.client.put(leadership.key, b'{"replica": "someone-else"}')
        await store.create("Rollout", "r", stepping_rollout(min_duration=60))

        async def stepped_down() -> bool:
            return not a.leading

        await poll(stepped_down, within=10)
        assert await state(store) == {}
        # The key goes away: "a" takes over and starts the rollout.
        await store.client.delete(leadership.key)

        async def started() -> bool:
            return (await state(store)).get("phase") == "Progressing"

        await poll(started, within=10)
        await store.delete("RoutingPolicy", "main")

        async def failed() -> bool:
            return (await state(store)).get("phase") == "Failed"

        await poll(failed, within=10)
        assert "RoutingPolicy 'main' is gone" in (await state(store))["message"]


async def test_a_follower_takes_the_key_from_a_silent_leader_before_its_lease_runs_out(
    etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    # A leader that holds the key under a 60 s lease but never renews its heartbeat, as a
    # driver does from the moment it is killed.
    client = EtcdClient([etcd.endpoint])
    await client.connect()
    store = Store(client, etcd_prefix)
    lease = await client.grant_lease(60)
    await client.put(
        store.keys.absolute(leader_key(LEADER_JOB)), b'{"replica": "ghost"}', lease=lease
    )
    silent_since = loop_time()
    try:
        async with controller(etcd.endpoint, etcd_prefix, "b") as (b, _):

            async def taken() -> bool:
                return b.leading

            await poll(taken, within=10)
            took = loop_time() - silent_since
            assert await b.election.holder() == "b"
    finally:
        await client.revoke_lease(lease)
        await client.close()
    # It waits for 0.6 of the 2 s TTL without a heartbeat, not for the lease's 60 s (the bound
    # within the TTL is the SIGKILL test's; here the machine's load must not fail the test).
    assert 1.2 <= took < 30, f"took the key {took:.2f}s after the leader went silent"


@pytest.mark.parametrize("leading", [True, False], ids=["leader", "follower"])
async def test_the_controller_stops_when_its_client_is_closed(
    etcd: EmbeddedEtcd, etcd_prefix: str, leading: bool
) -> None:
    # A closed client never works again: a leader beating its heartbeat, or a follower
    # campaigning, that retried on it would keep a shutting-down replica waiting for ever.
    async with contextlib.AsyncExitStack() as stack:
        if not leading:
            other, _ = await stack.enter_async_context(
                controller(etcd.endpoint, etcd_prefix, "other")
            )
            await poll(lambda: other.leading, within=10)
        client = EtcdClient([etcd.endpoint], timeout=1.0)
        await client.connect()
        mirror = StateMirror(client, etcd_prefix)
        watch = asyncio.create_task(mirror.run())
        await mirror.wait_synced(10)
        driver = RolloutController(
            client, Store(client, etcd_prefix).keys, lambda: mirror.items, "a", lease_ttl=2
        )
        task = asyncio.create_task(driver.run())
        try:
            await poll(lambda: driver.election.lease != 0 and driver.leading == leading, within=10)
            await client.close()
            async with asyncio.timeout(10):
                await task
        finally:
            for running in (task, watch):
                running.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
