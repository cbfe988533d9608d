"""A named endpoint's place on the hash ring follows its name, not its address, through a
real Envoy.

Three pools of three replicas each, on different ports, behind session affinity. Two pools
name their replicas alike (``r0``, ``r1``, ``r2``): every session lands on the replica of the
same name in both. The third pool's replicas have no names, so the ring places them by
address: the control shows placement by address differs, so the agreement of the named
pools comes from the names.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool
from harness.rig import api_client
from harness.wait import wait_until

from controlplane.local import free_port

pytestmark = pytest.mark.e2e

SESSIONS = 40


def test_replicas_named_alike_place_every_session_alike_whatever_their_ports(
    etcd_prefix: str, kvpilot_factory: Any, envoy_factory: Any, backends: Any
) -> None:
    replicas = backends(9, id_prefix="hk").replicas
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy_factory(xds_port=kvpilot.xds_port)
    api = api_client(kvpilot)
    groups = {"named-a": replicas[0:3], "named-b": replicas[3:6], "unnamed": replicas[6:9]}
    names: dict[str, str] = {}
    ports: dict[str, int] = {}
    for group, members in groups.items():
        body = pool(group, [r.port for r in members], health_check=FAST_HEALTH_CHECK)
        if group.startswith("named"):
            for index, (endpoint, replica) in enumerate(
                zip(body["spec"]["endpoints"], members, strict=True)
            ):
                endpoint["name"] = f"r{index}"
                names[replica.id] = f"r{index}"
        else:
            for index, replica in enumerate(members):
                names[replica.id] = f"r{index}"
        assert api.put(f"/v1/pools/{group}", json=body).is_success
        ports[group] = free_port()
        route = {"name": "chat", "tiers": [[group]], "sessionAffinity": {}}
        response = api.put(
            f"/v1/routingpolicies/{group}", json=policy(group, ports[group], [route])
        )
        assert response.is_success, response.text
    client = httpx.Client(timeout=10)

    def placed(group: str, session: str) -> str:
        reply = client.post(
            f"http://127.0.0.1:{ports[group]}/v1/chat/completions",
            json=chat(),
            headers={"x-session-id": session},
        )
        assert reply.status_code == 200, reply.text
        return names[reply.headers["x-backend-id"]]

    for group in groups:
        wait_until(lambda g=group: placed(g, "warm-up"), 30, message=f"Envoy to serve {group}")
    placement = {
        group: [placed(group, f"session-{n}") for n in range(SESSIONS)] for group in groups
    }

    assert placement["named-a"] == placement["named-b"]
    assert len(set(placement["named-a"])) == 3, "every replica should hold some sessions"
    assert placement["unnamed"] != placement["named-a"], (
        "placement by address matched placement by name for every session"
    )
