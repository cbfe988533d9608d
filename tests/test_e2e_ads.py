"""ADS with real Envoys, end to end: SotW and Delta, NACKs, status and metrics.

Real etcd, real `kvpilot serve` processes, real Envoys started from the bootstraps in
`deploy/envoy/`, and simulated replicas. Traffic assertions name the replica that answered
(`x-backend-id`); config assertions compare what kvpilot says it serves and what the Envoy says
it accepted (`/v1/status`) with what the Envoy itself reports (admin stats).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from harness.builders import policy, pool, route
from harness.envoy import xds_updates
from harness.rig import api_client, apply
from harness.status import TYPES, acked_everything, envoy_types, envoys, metric, served_versions
from harness.traffic import replicas_behind
from harness.wait import wait_until

from controlplane.local import EmbeddedEnvoy, free_port

pytestmark = pytest.mark.e2e

MODE = [pytest.param(False, id="sotw"), pytest.param(True, id="delta")]


def web_policy(
    name: str, pool_name: str, port: int, *, fleets: tuple[str, ...] = ("default",)
) -> Any:
    """A policy for `fleets` sending everything on `port` round robin to `pool_name`."""
    return policy(name, port, [route(pool_name, balancing="round_robin")], fleets=fleets)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another process (this test) holds: Envoy cannot bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("delta", MODE)
def test_config_arrives_traffic_flows_and_an_api_change_flows(
    delta: bool, etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, backends: Any
) -> None:
    first, second = backends(2, id_prefix="first"), backends(1, id_prefix="second")
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy = envoy_factory(xds_port=kvpilot.xds_port, delta=delta)
    port = free_port()
    api = api_client(kvpilot)
    apply(api, pool("first", [r.port for r in first.replicas], models=["sim-model"]))
    apply(api, pool("second", [r.port for r in second.replicas], models=["sim-model"]))
    apply(api, web_policy("web", "first", port))

    wait_until(
        lambda: replicas_behind(port) == {r.id for r in first.replicas},
        30,
        message="both replicas of pool 'first' to answer through Envoy",
    )
    before = wait_until(
        lambda: acked_everything(api, envoy), 30, message="the Envoy to ACK every type"
    )
    [connection] = [c for c in envoys(api) if c["node_id"] == envoy.node_id]
    assert connection["mode"] == ("delta" if delta else "sotw")
    assert connection["fleet"] == "default"
    assert all(t["last_nack"] is None for t in connection["types"].values())
    # The Envoy's own view: the versions it applied are kvpilot's content hashes.
    stats = envoy.stats()
    assert stats["cluster_manager.cds.version_text"] == before["CDS"]
    assert stats["listener_manager.lds.version_text"] == before["LDS"]

    # A change through the REST API: the route now goes to the other pool.
    apply(api, web_policy("web", "second", port))
    wait_until(
        lambda: replicas_behind(port) == {second.replicas[0].id},
        30,
        message="only pool 'second' to answer after the change",
    )
    after = wait_until(
        lambda: acked_everything(api, envoy), 30, message="the Envoy to ACK the change"
    )
    assert after["EDS"] != before["EDS"]
    assert all(t["last_nack"] is None for t in envoy_types(api, envoy.node_id).values())


@pytest.mark.parametrize("delta", MODE)
def test_a_listener_envoy_cannot_bind_is_nacked_and_shown_and_the_fix_flows(
    delta: bool,
    busy_port: int,
    etcd_prefix: str,
    kvpilot_factory: Any,
    envoy_factory: Any,
    backends: Any,
) -> None:
    replicas = backends(2, id_prefix="be")
    ports = [r.port for r in replicas.replicas]
    ids = {r.id for r in replicas.replicas}
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy = envoy_factory(xds_port=kvpilot.xds_port, delta=delta)
    other = envoy_factory(xds_port=kvpilot.xds_port, fleet="other", delta=delta)
    web_port, other_port, fixed_port = free_port(), free_port(), free_port()
    api = api_client(kvpilot)
    apply(api, pool("sim", ports, models=["sim-model"]))
    apply(api, web_policy("web", "sim", web_port))
    apply(api, web_policy("side", "sim", other_port, fleets=("other",)))
    wait_until(
        lambda: replicas_behind(web_port) == ids, 30, message="traffic through the default fleet"
    )
    wait_until(
        lambda: replicas_behind(other_port) == ids, 30, message="traffic through fleet 'other'"
    )
    good = wait_until(lambda: acked_everything(api, envoy), 30, message="the first ACKs")
    other_good = wait_until(lambda: acked_everything(api, other), 30, message="fleet 'other' ACKs")

    # kvpilot accepts this policy (nothing is wrong with it on paper), but its port is taken on
    # the Envoy's host, so Envoy rejects the listener.
    apply(api, web_policy("new", "sim", busy_port))

    def lds_nack() -> dict[str, Any] | None:
        nack: dict[str, Any] | None = (
            envoy_types(api, envoy.node_id).get("LDS", {}).get("last_nack")
        )
        return nack

    nack = wait_until(lds_nack, 30, message="the Envoy's LDS NACK to show in /v1/status")
    lds = envoy_types(api, envoy.node_id)["LDS"]
    assert lds["version_acked"] == good["LDS"], "the Envoy keeps the version it accepted"
    assert nack["version"] == lds["version_sent"] != good["LDS"]
    assert str(busy_port) in nack["message"], nack
    assert metric(kvpilot.api_url, "kvpilot_xds_nacks_total", type="LDS", fleet="default") >= 1
    assert envoy.stats()["listener_manager.lds.update_rejected"] == 1

    # The Envoy keeps serving its last good config, and the other fleet never noticed.
    assert replicas_behind(web_port) == ids
    assert replicas_behind(other_port) == ids
    assert acked_everything(api, other) == other_good
    assert all(t["last_nack"] is None for t in envoy_types(api, other.node_id).values())

    # The fix (a free port) flows to the Envoy, which ACKs it and serves on the new listener.
    apply(api, web_policy("new", "sim", fixed_port))
    wait_until(
        lambda: replicas_behind(fixed_port) == ids, 30, message="traffic on the fixed listener"
    )
    fixed = wait_until(lambda: acked_everything(api, envoy), 30, message="the fix to be ACKed")
    assert fixed["LDS"] != good["LDS"]
    assert replicas_behind(web_port) == ids
    # The rejected listener was never sent again: Envoy rejected exactly one update.
    assert envoy.stats()["listener_manager.lds.update_rejected"] == 1
    assert envoy_types(api, envoy.node_id)["LDS"]["version_acked"] == fixed["LDS"]


class TwoServerEnvoy(EmbeddedEnvoy):
    """An Envoy whose xDS cluster lists several kvpilot replicas: when one goes away, Envoy
    reconnects to another."""

    def __init__(self, *args: Any, xds_ports: list[int], **kwargs: Any) -> None:
        super().__init__(*args, xds_port=xds_ports[0], **kwargs)
        self.xds_ports = xds_ports

    def render(self) -> Any:
        path = super().render()
        config = yaml.safe_load(path.read_text())
        [xds] = [c for c in config["static_resources"]["clusters"] if c["name"] == "kvpilot_xds"]
        xds["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {
                "endpoint": {
                    "address": {"socket_address": {"address": self.xds_address, "port_value": p}}
                }
            }
            for p in self.xds_ports
        ]
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path


def applied(envoy: EmbeddedEnvoy) -> dict[str, Any]:
    """What an Envoy says it applied: per xDS subscription its version and the responses it
    received, applied and rejected (`harness.envoy.xds_updates`), and per resource in its config dump the version and the time it was last updated."""
    versions = {
        name: value for name, value in envoy.stats().items() if name.endswith(".version_text")
    }
    resources = {}
    for config in envoy.config_dump(include_eds=True)["configs"]:
        for key in (
            "dynamic_active_clusters",
            "dynamic_listeners",
            "dynamic_route_configs",
            "dynamic_endpoint_configs",
        ):
            for entry in config.get(key, []):
                entry = entry.get("active_state", entry)
                body = next(
                    v for k, v in entry.items() if k not in ("version_info", "last_updated")
                )
                name = body.get("name") or body.get("cluster_name")
                resources[f"{key}/{name}"] = (entry.get("version_info"), entry.get("last_updated"))
    return {"stats": versions, "updates": xds_updates(envoy), "resources": resources}


def placement(api: httpx.Client) -> dict[str, str]:
    """Node id -> the kvpilot replica it is connected to, for Envoys that hold every type."""
    return {
        c["node_id"]: c["replica"]
        for c in envoys(api)
        if len(c["types"]) == len(TYPES) and all(t["version_acked"] for t in c["types"].values())
    }


@pytest.mark.parametrize("delta", MODE)
def test_an_envoy_moving_to_another_replica_reloads_nothing_and_status_spans_replicas(
    delta: bool,
    etcd_prefix: str,
    kvpilot_factory: Any,
    envoy_factory: Any,
    backends: Any,
    tmp_path: Path,
) -> None:
    replicas = backends(2, id_prefix="be")
    ids = [r.id for r in replicas.replicas]
    kvpilots = [kvpilot_factory(etcd_prefix), kvpilot_factory(etcd_prefix)]
    apis = [api_client(k) for k in kvpilots]
    port, moving_port = free_port(), free_port()
    apply(apis[0], pool("sim", [r.port for r in replicas.replicas], models=["sim-model"]))
    apply(apis[0], web_policy("web", "sim", port))
    apply(apis[0], web_policy("mover", "sim", moving_port, fleets=("m",)))
    pinned = [envoy_factory(xds_port=k.xds_port, delta=delta) for k in kvpilots]
    moving = TwoServerEnvoy(
        tmp_path / "moving",
        xds_address="127.0.0.1",
        xds_ports=[k.xds_port for k in kvpilots],
        node_id="moving",
        fleet="m",
        delta=delta,
    )
    try:
        moving.start()
        wait_until(
            lambda: replicas_behind(moving_port) == set(ids), 30, message="traffic via moving"
        )

        # Both replicas serve the same content-hash versions, and each one's status lists the
        # Envoys of both: its own live, the other's from the records in etcd.
        nodes = {pinned[0].node_id, pinned[1].node_id, "moving"}
        where = wait_until(
            lambda: (p := placement(apis[0])) == placement(apis[1]) and p.keys() == nodes and p,
            30,
            message="both replicas' status to list all three Envoys with every type ACKed",
        )
        assert where[pinned[0].node_id] != where[pinned[1].node_id]
        for fleet in ("default", "m"):
            assert served_versions(apis[0], fleet) == served_versions(apis[1], fleet)

        # Stop the replica the moving Envoy is on: Envoy reconnects to the other one.
        source = 0 if where["moving"] == where[pinned[0].node_id] else 1
        target = 1 - source
        before = applied(moving)
        kvpilots[source].stop()
        served = served_versions(apis[target], "m")

        def moved() -> bool:
            now = {c["node_id"]: c for c in envoys(apis[target])}
            if set(now) != {pinned[target].node_id, "moving"}:
                return False  # the stopped replica's records go with its lease
            types = {t["type"]: t["version_acked"] for t in now["moving"]["types"].values()}
            return now["moving"]["replica"] == where[pinned[target].node_id] and types == served

        wait_until(moved, 60, message="the Envoy to show on the other replica, holding its config")
        # Envoy's own view: no version it had not applied before, and no update applied at all.
        assert applied(moving) == before
        assert replicas_behind(moving_port) == set(ids)

        # The new replica's stream is live: the next change flows through it.
        apply(apis[target], pool("sim", [replicas.replicas[0].port], models=["sim-model"]))
        wait_until(
            lambda: replicas_behind(moving_port) == {ids[0]},
            30,
            message="the change after the move",
        )
        assert applied(moving)["updates"] != before["updates"]
    finally:
        moving.stop()
