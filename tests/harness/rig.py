"""The end-to-end rig: a `kvpilot serve` process, an Envoy of the default fleet fed by it over
ADS, and the REST API as admin, with the calls every end-to-end test makes on it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from controlplane.local import EmbeddedEnvoy, KvpilotProcess, free_port
from controlplane.local.replicas import BackendProcess
from harness.auth import ADMIN
from harness.envoy import envoy_hosts, serves_listener
from harness.traffic import CHAT
from harness.wait import wait_until
from policies import KIND_PATHS

EnvoyFactory = Callable[..., EmbeddedEnvoy]
"""What the `envoy_factory` fixture returns: keyword arguments of EmbeddedEnvoy -> started Envoy."""
BackendFactory = Callable[..., BackendProcess]
"""What the `backends` fixture returns: (n, id_prefix=...) -> started BackendProcess."""
KvpilotFactory = Callable[..., KvpilotProcess]
"""What the `kvpilot_factory` fixture returns: (prefix, keyword arguments of KvpilotProcess)
-> started `kvpilot serve`."""


def api_client(kvpilot: KvpilotProcess) -> httpx.Client:
    """A client of `kvpilot`'s REST API that sends the admin token."""
    return httpx.Client(base_url=kvpilot.api_url, headers=ADMIN, timeout=10)


APPLY_ORDER = {"Fleet": 0, "Pool": 1}
"""Kinds applied before the others: a fleet's settings (its secrets directory) must be in
place before a listener needs them, and a policy's pools before the policy."""


def apply(api: httpx.Client, *objects: Mapping[str, Any]) -> None:
    """Create or replace objects through the REST API, fleets and pools first; each must
    succeed."""
    for obj in sorted(objects, key=lambda o: APPLY_ORDER.get(o["kind"], len(APPLY_ORDER))):
        path = f"/v1/{KIND_PATHS[obj['kind']]}/{obj['metadata']['name']}"
        response = api.put(path, json=obj)
        assert response.status_code in (200, 201), f"PUT {path}: {response.text}"


def ports_of(process: BackendProcess | Any) -> list[int]:
    """The ports of a backend process's replicas."""
    return [replica.port for replica in process.replicas]


@dataclass
class Rig:
    """One `kvpilot serve`, one Envoy it feeds, the REST API as admin, and a free port for the
    policy's listener."""

    kvpilot: KvpilotProcess
    envoy: EmbeddedEnvoy
    api: httpx.Client
    listener_port: int

    @classmethod
    def around(cls, kvpilot: KvpilotProcess, envoy: EmbeddedEnvoy) -> Rig:
        """The rig of a started kvpilot and Envoy, with a new API client and listener port."""
        return cls(kvpilot, envoy, api_client(kvpilot), free_port())

    def url(self, path: str = CHAT) -> str:
        """A URL on the policy's listener, through Envoy."""
        return f"http://127.0.0.1:{self.listener_port}{path}"

    def apply(self, *objects: Mapping[str, Any]) -> None:
        """Create or replace objects through the REST API, fleets and pools first."""
        apply(self.api, *objects)

    def hosts(self, cluster: str) -> dict[int, dict[str, str]]:
        """Port -> Envoy's view of each host of `cluster` (health_flags, weight, priority, ...)."""
        return envoy_hosts(self.envoy, cluster)

    def wait_ready(self, cluster: str, ports: Iterable[int], timeout: float = 30.0) -> None:
        """Wait until Envoy has exactly `ports` in `cluster`, its health checks pass on all of
        them, and the policy's listener serves (it goes active once its routes arrived)."""
        want = set(ports)

        def healthy() -> bool:
            hosts = self.hosts(cluster)
            return set(hosts) == want and all(
                host.get("health_flags") == "healthy" for host in hosts.values()
            )

        wait_until(
            healthy, timeout, message=f"Envoy to see {sorted(want)} healthy in cluster {cluster}"
        )
        wait_until(
            lambda: serves_listener(self.envoy, self.listener_port),
            timeout,
            message=f"Envoy's listener on {self.listener_port}",
        )

    def wait_down(self, cluster: str, ports: Iterable[int], timeout: float = 30.0) -> None:
        """Wait until Envoy's health checks have marked every one of `ports` in `cluster` as
        not healthy (a killed replica, say)."""
        down = set(ports)
        wait_until(
            lambda: all(self.hosts(cluster)[port]["health_flags"] != "healthy" for port in down),
            timeout,
            message=f"Envoy to mark {sorted(down)} down in cluster {cluster}",
        )
