"""A new route never answers 503 while its cluster warms, through a real Envoy.

Envoy takes a cluster added by CDS into use once its endpoints arrived and their first health
check completed, but a route goes live as soon as it arrives. kvpilot sends the routes after
the Envoy's ACK of the clusters (which Envoy holds back while they warm): a client sending
without pause from before a route exists sees the old route, then the new one, and never
``503 NC`` in between.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from harness.builders import policy, pool, route
from harness.rig import BackendFactory, EnvoyFactory, KvpilotFactory, Rig, ports_of
from harness.status import metric
from harness.wait import wait_until

pytestmark = pytest.mark.e2e

ROUNDS = 3
"""New routes added one after another (each a new cluster warming under load)."""
WAITS = "kvpilot_xds_cluster_warming_seconds_count"


class Sender:
    """Sends the same request without pause from a thread and keeps every answer."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.answers: list[tuple[int, str]] = []
        """(status, x-backend-id) of each answer, in order; (0, the error) when none came, and
        (status, Envoy's body: ``no healthy upstream``, ``no cluster``...) for an error."""
        self._url, self._headers = url, headers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sender:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                try:
                    response = client.post(self._url, json=body, headers=self._headers)
                except httpx.HTTPError as error:  # kept, so the assertion shows it
                    self.answers.append((0, repr(error)))
                    continue
                backend = response.headers.get("x-backend-id", "")
                if response.status_code != 200:  # Envoy's reason, so the assertion shows why
                    backend = f"{backend} {response.text[:80]!r}"
                self.answers.append((response.status_code, backend))

    def answered_by(self, prefix: str) -> bool:
        return any(backend.startswith(prefix) for _, backend in self.answers[-5:])


@pytest.fixture(params=["sotw", "delta"])
def rig(
    request: pytest.FixtureRequest,
    etcd_prefix: str,
    kvpilot_factory: KvpilotFactory,
    envoy_factory: EnvoyFactory,
) -> Iterator[Rig]:
    """conftest's `rig`, with its Envoy on either ADS variant."""
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy = envoy_factory(xds_port=kvpilot.xds_port, delta=request.param == "delta")
    rig = Rig.around(kvpilot, envoy)
    with rig.api:
        yield rig


def test_a_new_route_is_served_from_its_first_request(rig: Rig, backends: BackendFactory) -> None:
    old = backends(1, id_prefix="old")
    rig.apply(pool("old", ports_of(old)), policy("warm", rig.listener_port, [route("old")]))
    headers = {"x-round": "on"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    wait_until(
        lambda: httpx.post(rig.url(), json=body, headers=headers, timeout=10).status_code == 200,
        30,
        message="the first route to serve",
    )
    warmed_before = metric(rig.kvpilot.api_url, WAITS)
    routes = [route("old")]
    for n in range(ROUNDS):
        name = f"new{n}"
        replicas = backends(1, id_prefix=name)
        # Ahead of the others: from its first moment it takes every request of the sender.
        match = {"pathPrefix": "/", "headers": [{"name": "x-round", "value": "on"}]}
        routes = [route(name, name=name, match=match), *routes[-1:]]
        with Sender(rig.url(), headers) as sender:
            wait_until(lambda: len(sender.answers) >= 20, 30, message="the sender to start")
            rig.apply(pool(name, ports_of(replicas)), policy("warm", rig.listener_port, routes))
            wait_until(
                lambda name=name: sender.answered_by(name), 30, message=f"route {name} to serve"
            )
            # The routes waited for Envoy's answer to the clusters, not for the hold's limit.
            wait_until(
                lambda n=n: metric(rig.kvpilot.api_url, WAITS) >= warmed_before + n + 1,
                30,
                message="the wait for the new cluster to be counted",
            )
        codes = sorted({code for code, _ in sender.answers})
        timeouts = metric(
            rig.kvpilot.api_url, "kvpilot_xds_warming_timeouts_total", fleet="default"
        )
        assert codes == [200], (name, timeouts, [a for a in sender.answers if a[0] != 200][:5])
        switched = [backend.split("-")[0] for _, backend in sender.answers]
        assert switched[-1] == name, switched[-5:]
    assert metric(rig.kvpilot.api_url, "kvpilot_xds_warming_timeouts_total", fleet="default") == 0
