"""The rig of the end-to-end rollout tests: kvpilot replicas, two fleets of one real Envoy
each sharing one listener port (the kernel spreads connections between them, as an L4
balancer would), a stable and a canary pool of simulated replicas, and steady client traffic
with session affinity."""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from compiler.compile import listener_name
from controlplane.local import EmbeddedEnvoy, KvpilotProcess, free_port
from harness import builders
from harness.builders import FAST_HEALTH_CHECK, chat, pool
from harness.envoy import envoy_hosts
from harness.rig import api_client
from harness.wait import wait_until
from xdsserver.translate import AFFINITY_SUFFIX

LEASE_TTL = 3
"""--rollout-lease-ttl of every replica: a standby takes over after 0.6 of it (1.8 s) without
the driver's heartbeat, which leaves the SIGKILL test 1.2 s for the standby's reaction on a
loaded machine."""
CLUSTER = "chat/chat"
STEPS = (5, 25, 50, 100)


@dataclass
class Traffic:
    """Chat requests with session ids, sent on fresh connections so both Envoys get some.

    Every other request continues one of ``sessions`` conversations (what affinity is
    measured on, so few enough to be seen in every step); the others each start a new one.
    Sessions go to pools by their hash on the ring, not request by request: when all traffic
    came from 40 sessions, a 5% canary got none of them about one run in eight (0.95^40), and
    its first step waited for a sample that never came. New sessions land on the canary in
    its share of requests, whatever the ring looks like."""

    url: str
    sessions: int = 20
    pause: float = 0.01
    records: list[tuple[float, str, int, str]] = field(default_factory=list)
    """(time, session, status, replica that answered)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(limits=limits, timeout=10) as client:
            n = 0
            while not self._stop.is_set():
                session = f"s{n // 2 % self.sessions}" if n % 2 == 0 else f"new-{n}"
                n += 1
                try:
                    response = client.post(self.url, json=chat(), headers={"x-session-id": session})
                    status, by = response.status_code, response.headers.get("x-backend-id", "")
                except httpx.HTTPError:
                    status, by = 0, ""
                self.records.append((time.time(), session, status, by))
                time.sleep(self.pause)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def between(self, start: float, end: float) -> list[tuple[float, str, int, str]]:
        return [r for r in self.records if start <= r[0] < end]


@dataclass
class Rig:
    kvpilots: list[KvpilotProcess]
    envoys: list[EmbeddedEnvoy]
    api: httpx.Client
    port: int
    stable: Any
    canary: Any

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    def status(self, name: str) -> dict[str, Any]:
        response = self.api.get(f"/v1/rollouts/{name}/status")
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def wait_phase(self, name: str, phases: Iterable[str], timeout: float = 90) -> dict[str, Any]:
        """Wait until the rollout is in one of `phases`; on timeout the failure says where it
        stood (phase, step and what its live verdict was waiting for)."""
        wanted = set(phases)
        last: dict[str, Any] = {}

        def reached() -> bool:
            last.clear()
            last.update(self.status(name))
            return last["phase"] in wanted

        try:
            wait_until(reached, timeout, message=f"rollout {name} to reach {wanted}")
        except AssertionError as error:
            raise AssertionError(f"{error}; it stood at {standing(last)}") from None
        return self.status(name)

    def tier_weights(self) -> dict[str, int]:
        body = self.api.get("/v1/routingpolicies/chat").json()
        return {t["pool"]: t["weight"] for t in body["spec"]["routes"][0]["tiers"][0]["pools"]}

    def canary_shares(self) -> set[int]:
        """The canary's share (percent) of the route's endpoint weight, as each Envoy has it."""
        return {share for envoy in self.envoys if (share := self.canary_share(envoy)) is not None}

    def canary_share(self, envoy: EmbeddedEnvoy) -> int | None:
        """The canary's share (percent) of the route's endpoint weight in one Envoy."""
        canary_ports = {r.port for r in self.canary.replicas}
        hosts = envoy_hosts(envoy, CLUSTER)
        total = sum(int(h.get("weight", 0)) for h in hosts.values())
        if not total:
            return None
        mine = sum(int(h.get("weight", 0)) for p, h in hosts.items() if p in canary_ports)
        return round(100 * mine / total)

    def canary_requests(self, envoy: EmbeddedEnvoy) -> int:
        """Requests one Envoy has sent to the canary's replicas (either twin of the cluster)."""
        canary_ports = {r.port for r in self.canary.replicas}
        return sum(
            int(host.get("rq_total", 0))
            for cluster in (CLUSTER, CLUSTER + AFFINITY_SUFFIX)
            for port, host in envoy_hosts(envoy, cluster).items()
            if port in canary_ports
        )


def start_rig(
    prefix: str,
    kvpilot_factory: Any,
    envoy_factory: Any,
    backends: Any,
    *,
    envoys_on: tuple[int, int] = (0, 1),
    replicas: int = 2,
) -> Rig:
    """`replicas` kvpilot replicas (the first starts first, so it drives rollouts), two fleets
    of one Envoy each talking to the replicas `envoys_on`, and a stable and a canary pool."""
    extra = ["--rollout-lease-ttl", str(LEASE_TTL)]
    first = kvpilot_factory(prefix, extra_args=extra)
    wait_until(
        lambda: api_client(first).get("/v1/status").json().get("rolloutDriver") is not None,
        30,
        message="the first replica to take the rollouts lease",
    )
    kvpilots = [first, *(kvpilot_factory(prefix, extra_args=extra) for _ in range(replicas - 1))]
    api = api_client(kvpilots[-1])
    stable = backends(2, id_prefix="stable")
    canary = backends(2, id_prefix="canary")
    port = free_port()
    objects = [
        pool("stable", [r.port for r in stable.replicas], health_check=FAST_HEALTH_CHECK),
        pool("canary", [r.port for r in canary.replicas], health_check=FAST_HEALTH_CHECK),
        {
            "kind": "RoutingPolicy",
            "metadata": {"name": "chat"},
            "spec": {
                "fleets": ["blue", "green"],
                "listener": {"address": "127.0.0.1", "port": port},
                "routes": [
                    {
                        "name": "chat",
                        "tiers": [{"pools": [{"pool": "stable", "weight": 100}]}],
                        "sessionAffinity": {"header": "x-session-id"},
                        # Clients see every canary failure, so the test can count them.
                        "retries": {"attempts": 0},
                    }
                ],
            },
        },
    ]
    for obj in objects:
        path = f"/v1/{'pools' if obj['kind'] == 'Pool' else 'routingpolicies'}/{obj['metadata']['name']}"
        response = api.put(path, json=obj)
        assert response.status_code in (200, 201), response.text
    envoys = [
        envoy_factory(xds_port=kvpilots[min(envoys_on[0], replicas - 1)].xds_port, fleet="blue"),
        envoy_factory(xds_port=kvpilots[min(envoys_on[1], replicas - 1)].xds_port, fleet="green"),
    ]
    stable_ports = {r.port for r in stable.replicas}

    def serving() -> bool:
        for envoy in envoys:
            hosts = envoy_hosts(envoy, CLUSTER)
            if set(hosts) != stable_ports or any(
                h.get("health_flags") != "healthy" for h in hosts.values()
            ):
                return False
            listeners = [
                listener
                for config in envoy.config_dump()["configs"]
                for listener in config.get("dynamic_listeners", [])
                if listener["name"] == listener_name(port)
            ]
            if not listeners or "active_state" not in listeners[0]:
                return False
        return True

    wait_until(serving, 60, message="both Envoys serving the stable pool")
    return Rig(kvpilots, envoys, api, port, stable, canary)


def rollout(
    name: str,
    *,
    min_duration: float = 1.5,
    min_sample: int = 10,
    rules: list[dict[str, Any]] | None = None,
    steps: Iterable[int] = STEPS,
) -> dict[str, Any]:
    """A Rollout of the rig's canary pool beside its stable pool on route chat/chat."""
    return builders.rollout(
        name,
        target=("chat", "chat"),
        stable="stable",
        canary="canary",
        steps=builders.rollout_steps(steps, min_duration),
        analysis={
            "minSample": min_sample,
            "interval": "250ms",
            "rules": rules or [{"metric": "errorRate", "max": 0.05}],
        },
    )


def standing(status: dict[str, Any]) -> str:
    """A rollout's status in one line: phase, step, the step's sample and each rule's outcome
    (with what a waiting rule waits for)."""
    if not status:
        return "no status read"
    verdict = status.get("verdict") or {}
    rules = "; ".join(
        f"{r['rule']} {r['outcome']}" + (f" ({r['message']})" if r.get("message") else "")
        for r in verdict.get("rules", [])
    )
    return (
        f"phase {status.get('phase')}, step {status.get('step')} {status.get('weights')}, "
        f"canary {verdict.get('canary')}, stable {verdict.get('stable')}, rules: {rules or '-'}"
    )


def create(rig: Rig, body: dict[str, Any]) -> None:
    response = rig.api.post("/v1/rollouts", json=body)
    assert response.status_code == 201, response.text


def step_events(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [event for event in status["history"] if event["event"] == "step"]


def sessions_moved(
    traffic: Traffic, steps: list[dict[str, Any]], end: float, canary_ids: set[str]
) -> list[dict[str, int]]:
    """Per step change: sessions that moved stable->canary (forced by the weight change),
    between stable replicas, and canary->stable; from each session's last answer per step."""
    windows = list(itertools.pairwise([e["at"] for e in steps] + [end]))
    owners = []
    for start, stop in windows:
        last: dict[str, str] = {}
        for _, session, status, by in traffic.between(start + 0.3, stop):
            if status == 200:
                last[session] = by
        owners.append(last)
    out = []
    for before, after in itertools.pairwise(owners):
        counts: collections.Counter[str] = collections.Counter()
        for session, old in before.items():
            new = after.get(session)
            if new is None or new == old:
                continue
            kinds = (
                "canary" if old in canary_ids else "stable",
                "canary" if new in canary_ids else "stable",
            )
            counts["->".join(kinds)] += 1
        out.append(dict(counts))
    return out
