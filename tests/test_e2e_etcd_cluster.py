"""kvpilot on a 3-member etcd cluster while members die: nothing acknowledged is lost.

Writes go through the REST API without pause while the leader is killed (the cluster keeps
quorum: writes resume once kvpilot has moved to a live member), then a follower (quorum is
lost: writes fail, reads come from kvpilot's mirror), then both come back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ADMIN_TOKEN, READ_TOKEN
from routing_harness import pool
from util import wait_until

from controlplane.etcd import EtcdClient, EtcdError
from controlplane.launchers import EmbeddedEtcd, EmbeddedEtcdCluster, KvpilotProcess

pytestmark = pytest.mark.e2e

HEADERS = {"authorization": f"Bearer {ADMIN_TOKEN}"}


class Writer:
    """Creates pools p-0, p-1, ... one after another and records how each write ended."""

    def __init__(self, api_url: str) -> None:
        self.client = httpx.Client(base_url=api_url, headers=HEADERS, timeout=15)
        self.acked: list[tuple[float, str]] = []
        self.failed: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.close()

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            name = f"p-{index}"
            index += 1
            try:
                response = self.client.put(f"/v1/pools/{name}", json=pool(name, [8000]))
                status = response.status_code
            except httpx.HTTPError:
                status = 0
            if status in (200, 201):
                self.acked.append((time.monotonic(), name))
            else:
                self.failed.append((time.monotonic(), name, status))
            time.sleep(0.02)

    def acked_since(self, moment: float) -> int:
        return sum(1 for at, _ in self.acked if at > moment)

    def failed_since(self, moment: float) -> int:
        return sum(1 for at, _, _ in self.failed if at > moment)


def leader_of(members: list[EmbeddedEtcd]) -> EmbeddedEtcd:
    async def ask() -> EmbeddedEtcd:
        ids = {}
        leader = 0
        for member in members:
            if not member.running():
                continue
            async with EtcdClient([member.endpoint], timeout=2) as client:
                try:
                    status = await client.status()
                except EtcdError:
                    continue
                ids[status.member_id] = member
                leader = leader or status.leader
        return ids[leader]

    return asyncio.run(ask())


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmbeddedEtcdCluster]:
    # No fsync: a killed process leaves its writes in the page cache; only a machine crash
    # would lose them, and that is not what this test tries.
    cluster = EmbeddedEtcdCluster(tmp_path / "etcd", extra_args=["--unsafe-no-fsync"]).start()
    yield cluster
    cluster.stop()


def test_leader_then_follower_die_and_return_and_no_acknowledged_write_is_lost(
    cluster: EmbeddedEtcdCluster, tmp_path: Path, etcd_prefix: str
) -> None:
    kvpilot = KvpilotProcess(
        tmp_path / "kvpilot",
        etcd_endpoints=cluster.endpoints,
        prefix=etcd_prefix,
        env={"KVPILOT_ADMIN_TOKEN": ADMIN_TOKEN, "KVPILOT_READ_TOKEN": READ_TOKEN},
    ).start()
    try:
        with Writer(kvpilot.api_url) as writer:
            wait_until(lambda: len(writer.acked) >= 20, 30, message="writes before any failure")

            # 1. The leader dies; two of three members keep quorum and elect a new leader.
            leader = leader_of(cluster.members)
            killed = time.monotonic()
            leader.kill()
            wait_until(
                lambda: writer.acked_since(killed) >= 10,
                60,
                message="writes to resume after the leader died",
            )
            resumed = min(at for at, _ in writer.acked if at > killed)
            print(f"writes resumed {resumed - killed:.2f}s after the leader was killed")

            # 2. A follower dies too: no quorum. Writes fail (none is acknowledged), reads
            # are answered from kvpilot's mirror, marked stale.
            follower = next(m for m in cluster.members if m.running())
            lost = time.monotonic()
            follower.kill()
            wait_until(
                lambda: writer.failed_since(lost) >= 2, 60, message="writes to fail without quorum"
            )
            with httpx.Client(base_url=kvpilot.api_url, headers=HEADERS, timeout=15) as api:
                stale = wait_until(
                    lambda: (r := api.get("/v1/pools/p-0")).headers.get("x-kvpilot-stale") and r,
                    60,
                    message="a stale read from the mirror",
                )
            assert stale.status_code == 200 and stale.json()["metadata"]["name"] == "p-0"

            # 3. Both come back with their data: writes resume.
            restored = time.monotonic()
            cluster.start()
            wait_until(
                lambda: writer.acked_since(restored) >= 10,
                90,
                message="writes to resume once quorum is back",
            )

        # Nothing acknowledged was lost: every pool a write was acknowledged for is there,
        # read through the API from etcd itself (not the mirror).
        acked = {name for _, name in writer.acked}
        with httpx.Client(base_url=kvpilot.api_url, headers=HEADERS, timeout=15) as api:
            listed = wait_until(
                lambda: (
                    (r := api.get("/v1/pools")).status_code == 200
                    and "x-kvpilot-stale" not in r.headers
                    and r
                ),
                60,
                message="a fresh list from etcd",
            )
        present = {item["metadata"]["name"] for item in listed.json()["items"]}
        assert acked - present == set(), sorted(acked - present)
        assert len(acked) >= 40
    finally:
        kvpilot.stop()
