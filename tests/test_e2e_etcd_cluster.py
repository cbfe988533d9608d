"""kvpilot on a 3-member etcd cluster while members die: nothing acknowledged is lost.

Writes go through the REST API without pause while the leader is killed (the cluster keeps
quorum: writes resume once kvpilot has moved to a live member), then a follower (quorum is
lost: writes fail, reads come from kvpilot's mirror), then both come back.

All along, requests go through a real Envoy fed by that kvpilot: none fails, Envoy's config
changes only when a weight write through the API was acknowledged (and each such write reaches
it), and at the end traffic follows the last acknowledged weights.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.auth import ADMIN, TOKEN_ENV
from harness.builders import FAST_HEALTH_CHECK, policy, pool
from harness.rig import Rig
from harness.traffic import Traffic
from harness.wait import wait_until

from controlplane.etcd import EtcdClient, EtcdError
from controlplane.local import (
    EmbeddedEnvoy,
    EmbeddedEtcd,
    EmbeddedEtcdCluster,
    KvpilotProcess,
    free_port,
)

pytestmark = pytest.mark.e2e


class Writer:
    """Creates pools p-0, p-1, ... one after another and records how each write ended."""

    def __init__(self, api_url: str) -> None:
        self.client = httpx.Client(base_url=api_url, headers=ADMIN, timeout=15)
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
                response = self.client.put(
                    f"/v1/pools/{name}", json=pool(name, [8000], health_check=FAST_HEALTH_CHECK)
                )
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


def applied_versions(envoy: EmbeddedEnvoy) -> dict[str, str]:
    """Resource -> the xDS version Envoy applied for it (listeners, clusters, routes), or the
    assignment itself for endpoints. Versions are content hashes: they move only when the
    config does."""
    versions: dict[str, str] = {}
    for config in envoy.config_dump(include_eds=True)["configs"]:
        for listener in config.get("dynamic_listeners", []):
            active = listener.get("active_state", {})
            versions[f"listener {listener['name']}"] = active.get("version_info", "")
        for cluster in config.get("dynamic_active_clusters", []):
            versions[f"cluster {cluster['cluster']['name']}"] = cluster["version_info"]
        for route in config.get("dynamic_route_configs", []):
            versions[f"route {route['route_config']['name']}"] = route["version_info"]
        for endpoints in config.get("dynamic_endpoint_configs", []):
            name = endpoints["endpoint_config"]["cluster_name"]
            # Envoy keeps no version for an EDS assignment: the assignment stands in for it.
            versions[f"endpoints {name}"] = json.dumps(endpoints["endpoint_config"], sort_keys=True)
    return versions


def split(listener_port: int, blue: int, green: int) -> dict[str, object]:
    tier = [{"pool": "blue", "weight": blue}, {"pool": "green", "weight": green}]
    return policy("chat", listener_port, [{"name": "all", "tiers": [tier]}])


def write_weights(api_url: str, listener_port: int, blue: int, green: int) -> None:
    """PUT the split until the API acknowledges it (it may answer 503 while kvpilot moves
    to a live member)."""
    with httpx.Client(base_url=api_url, headers=ADMIN, timeout=15) as api:

        def acked() -> bool:
            try:
                body = split(listener_port, blue, green)
                return api.put("/v1/routingpolicies/chat", json=body).status_code in (200, 201)
            except httpx.HTTPError:
                return False

        wait_until(acked, 60, message=f"the write of weights {blue}/{green} to be acknowledged")


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
    cluster: EmbeddedEtcdCluster,
    tmp_path: Path,
    etcd_prefix: str,
    envoy_factory: Any,
    backends: Any,
) -> None:
    kvpilot = KvpilotProcess(
        tmp_path / "kvpilot",
        etcd_endpoints=cluster.endpoints,
        prefix=etcd_prefix,
        env=TOKEN_ENV,
    ).start()
    api = httpx.Client(base_url=kvpilot.api_url, headers=ADMIN, timeout=15)
    try:
        blue = backends(1, id_prefix="blue")
        green = backends(1, id_prefix="green")
        envoy = envoy_factory(xds_port=kvpilot.xds_port)
        rig = Rig(kvpilot, envoy, api, free_port())
        rig.apply(
            pool("blue", [blue.replicas[0].port], health_check=FAST_HEALTH_CHECK),
            pool("green", [green.replicas[0].port], health_check=FAST_HEALTH_CHECK),
            split(rig.listener_port, 100, 0),
        )
        # A pool at weight 0 is left out of the cluster: Envoy sees blue alone.
        rig.wait_ready("chat/all", [blue.replicas[0].port], timeout=60)

        with (
            Traffic(rig.url(), pause=0.01, limit=20_000, timeout=15) as traffic,
            Writer(kvpilot.api_url) as writer,
        ):
            wait_until(lambda: len(writer.acked) >= 20, 30, message="writes before any failure")
            assert traffic.latest_all_on("blue")
            before = applied_versions(envoy)

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
            # Pools no route uses are not Envoy config: nothing changed for Envoy yet.
            assert applied_versions(envoy) == before

            # An acknowledged weight write reaches Envoy and the traffic follows it.
            write_weights(kvpilot.api_url, rig.listener_port, 0, 100)
            wait_until(
                lambda: applied_versions(envoy) != before, 60, message="the new weights in Envoy"
            )
            wait_until(lambda: traffic.latest_all_on("green"), 60, message="traffic on green")
            after_write = applied_versions(envoy)

            # 2. A follower dies too: no quorum. Writes fail (none is acknowledged), reads
            # are answered from kvpilot's mirror, marked stale.
            follower = next(m for m in cluster.members if m.running())
            lost = time.monotonic()
            follower.kill()
            wait_until(
                lambda: writer.failed_since(lost) >= 2, 60, message="writes to fail without quorum"
            )
            stale = wait_until(
                lambda: (r := api.get("/v1/pools/p-0")).headers.get("x-kvpilot-stale") and r,
                60,
                message="a stale read from the mirror",
            )
            assert stale.status_code == 200 and stale.json()["metadata"]["name"] == "p-0"
            assert applied_versions(envoy) == after_write
            assert traffic.latest_all_on("green")

            # 3. Both come back with their data: writes resume, and Envoy is told nothing new
            # (kvpilot re-reads the same state).
            restored = time.monotonic()
            cluster.start()
            wait_until(
                lambda: writer.acked_since(restored) >= 10,
                90,
                message="writes to resume once quorum is back",
            )
            assert applied_versions(envoy) == after_write

            # The last acknowledged weights win: traffic follows them.
            write_weights(kvpilot.api_url, rig.listener_port, 100, 0)
            wait_until(
                lambda: applied_versions(envoy) != after_write,
                60,
                message="the last weights in Envoy",
            )
            wait_until(lambda: traffic.latest_all_on("blue"), 60, message="traffic on blue")

        # Not one request through Envoy failed while etcd members died and came back.
        assert traffic.failed() == [], traffic.failed()[:10]
        assert len(traffic.results) >= 100
        print(f"{len(traffic.results)} requests through Envoy, none failed")

        # Nothing acknowledged was lost: every pool a write was acknowledged for is there,
        # read through the API from etcd itself (not the mirror).
        acked = {name for _, name in writer.acked}
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
        api.close()
        kvpilot.stop()
