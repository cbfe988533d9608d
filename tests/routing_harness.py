"""Helpers for the end-to-end routing tests: policy objects, one kvpilot + Envoy rig, counting
which replica answered, and binomial bounds for statistical assertions."""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from conftest import ADMIN_TOKEN
from util import wait_until

from controlplane.launchers import EmbeddedEnvoy, KvpilotProcess
from policies import KIND_PATHS
from policies.compile import listener_name

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
CHAT = "/v1/chat/completions"


def pool(
    name: str, ports: Iterable[int], *, models: Iterable[str] = (), **spec: Any
) -> dict[str, Any]:
    """A Pool of replicas on 127.0.0.1 whose health is checked every 0.5 s (start-up stays
    quick and failover is seen within a second)."""
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Pool",
        "metadata": {"name": name},
        "spec": {
            "models": list(models),
            "endpoints": [{"address": "127.0.0.1", "port": port} for port in ports],
            "healthCheck": {"interval": "500ms"},
            **spec,
        },
    }


def policy(name: str, listener_port: int, routes: list[dict[str, Any]]) -> dict[str, Any]:
    """A RoutingPolicy listening on 127.0.0.1:`listener_port`."""
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": name},
        "spec": {"listener": {"port": listener_port, "address": "127.0.0.1"}, "routes": routes},
    }


@dataclass
class Rig:
    """One `kvpilot serve`, one Envoy of the default fleet, and the REST API as admin."""

    kvpilot: KvpilotProcess
    envoy: EmbeddedEnvoy
    api: httpx.Client
    listener_port: int

    def url(self, path: str = CHAT) -> str:
        """A URL on the policy's listener, through Envoy."""
        return f"http://127.0.0.1:{self.listener_port}{path}"

    def apply(self, *objects: Mapping[str, Any]) -> None:
        """Create or replace objects through the REST API, pools first."""
        for obj in sorted(objects, key=lambda o: o["kind"] != "Pool"):
            path = f"/v1/{KIND_PATHS[obj['kind']]}/{obj['metadata']['name']}"
            response = self.api.put(path, json=obj)
            assert response.status_code in (200, 201), f"PUT {path}: {response.text}"

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
            self._listener_active, timeout, message=f"Envoy's listener on {self.listener_port}"
        )

    def _listener_active(self) -> bool:
        for config in self.envoy.config_dump()["configs"]:
            for listener in config.get("dynamic_listeners", []):
                if listener["name"] == listener_name(self.listener_port):
                    return "active_state" in listener
        return False


def envoy_hosts(envoy: EmbeddedEnvoy, cluster: str) -> dict[int, dict[str, str]]:
    """Port -> field -> value of the hosts of `cluster`, from Envoy's admin `/clusters`."""
    hosts: dict[int, dict[str, str]] = collections.defaultdict(dict)
    for line in envoy.clusters().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and ":" in parts[1]:
            hosts[int(parts[1].rsplit(":", 1)[1])][parts[2]] = parts[3]
    return dict(hosts)


def answered_by(response: httpx.Response) -> str:
    """The replica that answered (`x-backend-id`), or `status-N` when Envoy itself answered."""
    return response.headers.get("x-backend-id", f"status-{response.status_code}")


def chat(model: str = "sim-model", content: str = "hi", **extra: Any) -> dict[str, Any]:
    """An OpenAI chat completion request body."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def send(
    client: httpx.Client,
    url: str,
    count: int,
    *,
    headers: Mapping[str, str] | None = None,
    body: Mapping[str, Any] | None = None,
) -> list[tuple[int, str]]:
    """Send `count` chat requests one after another; (status, replica) of each."""
    out = []
    for _ in range(count):
        response = client.post(url, json=dict(body or chat()), headers=dict(headers or {}))
        out.append((response.status_code, answered_by(response)))
    return out


class Traffic:
    """Clients sending chat requests back to back on threads, from `with` until its end.

    `results` holds (status, replica) of each finished request in order of completion; a
    request that got no HTTP answer (connection reset, timeout) counts as status 0 with the
    exception's name as replica, so a test can count every failure a user would have seen.
    """

    def __init__(self, url: str, *, workers: int = 4) -> None:
        self.url = url
        self.results: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(self.url, json=chat())
                    result = (response.status_code, answered_by(response))
                except httpx.HTTPError as exc:
                    result = (0, type(exc).__name__)
                with self._lock:
                    self.results.append(result)

    def finished(self) -> int:
        """How many requests have finished so far."""
        with self._lock:
            return len(self.results)

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        """Wait until `count` requests in all have finished."""
        wait_until(lambda: self.finished() >= count, timeout, message=f"{count} requests")

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)


def binomial_bounds(n: int, p: float, alpha: float = 1e-6) -> tuple[int, int]:
    """The narrowest-ish [lo, hi] with P(X < lo) + P(X > hi) < alpha for X ~ Binomial(n, p):
    each tail gets alpha / 2."""
    # In log space: math.comb(n, k) overflows a float from n of about 1,030.
    log_p, log_q = math.log(p), math.log1p(-p)
    pmf = [
        math.exp(
            math.lgamma(n + 1)
            - math.lgamma(k + 1)
            - math.lgamma(n - k + 1)
            + k * log_p
            + (n - k) * log_q
        )
        for k in range(n + 1)
    ]
    lo, tail = 0, 0.0
    while tail + pmf[lo] < alpha / 2:
        tail += pmf[lo]
        lo += 1
    hi, tail = n, 0.0
    while tail + pmf[hi] < alpha / 2:
        tail += pmf[hi]
        hi -= 1
    return lo, hi
