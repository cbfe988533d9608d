"""Live telemetry to Envoy, end to end: backends' load -> (agent ->) etcd -> kvpilot -> Envoy.

Real etcd, a real `kvpilot serve`, a real Envoy and tiny test backends whose /metrics (and ORCA
response headers) the test controls. The closed loop runs through the real agent; the
staleness and hysteresis cases write telemetry records straight into etcd, which is what an
agent does, so that their timing is exact.
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from harness.agent import MetricsBackend, start_agent_process
from harness.auth import ADMIN
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool, route
from harness.envoy import endpoint_weights, health_flags, serves_listener
from harness.status import metric
from harness.traffic import served_by
from harness.wait import poll
from harness.xdsclient import sent_endpoint_weights

from controlplane.agent.scrape import Agent, AgentConfig, Target
from controlplane.etcd import EtcdClient
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEnvoy, EmbeddedEtcd, free_port
from signals.saturation import LOOSEN_DWELL, MIN_DWELL, PEAK_HOLD, usable_batch
from xdsserver.translate import SATURATED_SUFFIX, UNBOUNDED_SUFFIX

pytestmark = pytest.mark.e2e

CLUSTER = "web/all"


def telemetry_pool(ports: list[int], *, max_age: str = "10s") -> dict[str, Any]:
    """Pool `sim` of the test backends, read as vLLM; health checks every 0.5 s keep start-up
    quick."""
    return pool(
        "sim",
        ports,
        health_check=FAST_HEALTH_CHECK,
        telemetry={"format": "vllm", "maxAge": max_age},
    )


def web_policy(
    listener_port: int, balancing: str, *, affinity: bool | dict[str, Any] = False
) -> dict[str, Any]:
    """Policy `web` over pool `sim`; `affinity` True for session affinity at its defaults,
    or the ``sessionAffinity`` fields."""
    fields: dict[str, Any] = {"balancing": balancing}
    if affinity:
        fields["sessionAffinity"] = {} if affinity is True else affinity
    return policy("web", listener_port, [route("sim", **fields)])


class Setup:
    def __init__(
        self,
        kvpilot: Any,
        envoy: EmbeddedEnvoy,
        backends: list[MetricsBackend],
        listener_port: int,
        store: Store,
    ) -> None:
        self.kvpilot = kvpilot
        self.envoy = envoy
        self.backends = backends
        self.ports = [b.port for b in backends]
        self.listener_port = listener_port
        self.url = f"http://127.0.0.1:{listener_port}/v1/chat/completions"
        self.store = store

    def weights(self, cluster: str = CLUSTER) -> dict[int, int]:
        return endpoint_weights(self.envoy, cluster)

    async def wait_weights(
        self, expected: dict[int, int], within: float, what: str, cluster: str = CLUSTER
    ) -> float:
        """Wait until Envoy has `expected`; return how long it took."""
        started = time.monotonic()

        seen: list[dict[int, int]] = [{}]

        async def reached() -> bool:
            seen[0] = await asyncio.to_thread(self.weights, cluster)
            return seen[0] == expected

        try:
            await poll(reached, within, what)
        except AssertionError as error:
            raise AssertionError(f"{error}: Envoy has {seen[0]}, expected {expected}") from None
        return time.monotonic() - started

    async def put(self, port: int, **signals: float) -> None:
        await self.store.put_telemetry(
            "sim", f"127.0.0.1:{port}", {"at": signals.pop("at", time.time()), **signals}
        )


@pytest.fixture
async def make_setup(
    etcd: EmbeddedEtcd,
    etcd_prefix: str,
    kvpilot_factory: Any,
    envoy_factory: Any,
) -> AsyncIterator[Callable[..., Any]]:
    client = EtcdClient([etcd.endpoint])
    await client.connect()
    started: list[MetricsBackend] = []

    async def make(
        balancing: str,
        *,
        max_age: str = "10s",
        static: bool = True,
        affinity: bool | dict[str, Any] = False,
    ) -> Setup:
        backends = [MetricsBackend(f"be-{i}").start() for i in range(3)]
        started.extend(backends)
        kvpilot = await asyncio.to_thread(kvpilot_factory, etcd_prefix)
        envoy = await asyncio.to_thread(envoy_factory, xds_port=kvpilot.xds_port)
        listener_port = free_port()
        ports = [b.port for b in backends] if static else []
        async with httpx.AsyncClient(base_url=kvpilot.api_url, headers=ADMIN) as api:
            response = await api.put("/v1/pools/sim", json=telemetry_pool(ports, max_age=max_age))
            assert response.status_code in (200, 201), response.text
            response = await api.put(
                "/v1/routingpolicies/web",
                json=web_policy(listener_port, balancing, affinity=affinity),
            )
            assert response.status_code in (200, 201), response.text
        return Setup(kvpilot, envoy, backends, listener_port, Store(client, etcd_prefix))

    yield make
    for backend in started:
        backend.stop()
    await client.close()


class Twins:
    """An affinity route's twin clusters (the same ring under different bounded loads): which
    replica each session lands on, which twin answers, and the batch telemetry that moves the
    route from one twin to another."""

    def __init__(self, setup: Setup, max_running: int) -> None:
        self.setup = setup
        self.max_running = max_running

    def placement(self) -> dict[str, str]:
        """Which replica answers each of 24 sessions."""
        with httpx.Client(timeout=10) as client:
            return {
                session: client.post(
                    self.setup.url, json=chat(), headers={"x-session-id": session}
                ).headers.get("x-backend-id", "none")
                for session in (f"session-{index}" for index in range(24))
            }

    def served_by(self, twin: str) -> bool:
        """The next session request is answered through `twin`."""
        counter = f"cluster.{twin}.upstream_rq_total"

        def requests() -> int:
            stats = self.setup.envoy.stats(f"^{re.escape(counter)}$")
            return int(stats.get(counter, 0))

        before = requests()
        httpx.post(self.setup.url, json=chat(), headers={"x-session-id": "probe"}, timeout=10)
        return requests() > before

    async def batches(self, running: float) -> None:
        """Every replica reports `running` in flight out of its batch of `max_running`."""
        for port in self.setup.ports:
            await self.setup.put(port, running=running, max_running=self.max_running)


async def affinity_twins(
    make_setup: Callable[..., Any],
    twins: tuple[str, ...],
    *,
    capacity_bound: bool,
    max_running: int,
) -> Twins:
    """A telemetry affinity route (``capacityBound`` as given) with every one of `twins` in
    Envoy. A long maxAge: the records are written once and must not go stale meanwhile."""
    setup: Setup = await make_setup(
        "telemetry", affinity={"capacityBound": capacity_bound}, max_age="60s"
    )
    for twin in twins:
        await setup.wait_weights(dict.fromkeys(setup.ports, 100), 30, f"{twin} in Envoy", twin)
    # Clusters arrive before the listener that routes to them: wait for it too, or the first
    # session request can find the port closed.
    await poll(
        lambda: asyncio.to_thread(serves_listener, setup.envoy, setup.listener_port),
        30,
        "the policy's listener in Envoy",
    )
    return Twins(setup, max_running)


async def test_a_long_queue_lowers_the_weight_in_envoy_and_traffic_moves_away(
    make_setup: Callable[..., Any],
) -> None:
    setup: Setup = await make_setup("telemetry")
    ports = setup.ports
    await setup.wait_weights(dict.fromkeys(ports, 100), 30, "static weights first")
    agent = Agent(
        setup.store,
        AgentConfig([], [Target(pool="sim", url=b.url) for b in setup.backends], interval=0.2),
    )
    task = asyncio.create_task(agent.run())
    try:
        busy = setup.backends[0]
        busy.waiting = 20  # the pool's longest queue, well above queue_ref: factor 0.1
        # Agent interval 0.2 s + push-rate cap 1 s + debounce: about 1.5 s unloaded; the
        # deadline is generous and the time is reported.
        took = await setup.wait_weights({ports[0]: 10, ports[1]: 100, ports[2]: 100}, 30, "lower")
        print(f"the lowered weight reached Envoy {took:.2f}s after the queue grew")
        counts = await asyncio.to_thread(served_by, setup.url, 63)
        assert counts[busy.id] <= 10, counts  # expected 10/210 of 63 = 3
        assert counts["be-1"] >= 20 and counts["be-2"] >= 20, counts

        busy.waiting = 40  # over the saturation bound: DEGRADED, no new work while others cope
        await poll(
            lambda: asyncio.to_thread(
                lambda: "degraded_eds_health" in health_flags(setup.envoy, CLUSTER)[ports[0]]
            ),
            15,
            "the saturated backend to be DEGRADED in Envoy",
        )
        # Envoy sends degraded hosts only what the healthy ones cannot take: with 2 of 3
        # healthy and the default overprovisioning factor 1.4, that is 100 - 1.4 * 66.7 = 7%.
        counts = await asyncio.to_thread(served_by, setup.url, 60)
        assert counts[busy.id] <= 10, counts

        busy.waiting = 0
        await setup.wait_weights(dict.fromkeys(ports, 100), 15, "recovery")
        assert "degraded" not in health_flags(setup.envoy, CLUSTER)[ports[0]]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_on_an_affinity_route_a_slow_replica_gets_less_of_the_ring_and_a_queue_nothing(
    make_setup: Callable[..., Any],
) -> None:
    # A long maxAge: the first record is stamped 5 s back, and on a loaded machine its
    # compile may come late enough for a default maxAge to call it stale (then no fall).
    setup: Setup = await make_setup("telemetry", affinity=True, max_age="60s")
    ports, ring = setup.ports, CLUSTER + "/affinity"
    await setup.wait_weights(dict.fromkeys(ports, 100), 30, "static weights first", ring)
    # Two records in a row (a fall needs two): the first replica is 3x slower per output
    # token and has by far the longest queue. Load weights would drop it to the floor (10)
    # and mark it DEGRADED, moving all its sessions; capacity weights give it the ring share
    # of its speed (35) and leave the queue to bounded load.
    held = {"endpoint": f"127.0.0.1:{ports[0]}", "pool": "sim"}
    for earlier in (5.0, 0.0):
        # Stamped when written: waiting for the first record's compile may take seconds on a
        # loaded machine, and a second record stamped before that wait could already be stale.
        at = time.time() - earlier
        # The slow replica's record last: a change that finds kvpilot idle is compiled at
        # once, and a compile that saw the slow record beside only one other (median 0.06,
        # speed 0.67, inside the band) would count it as no evidence. An agent writes a
        # round in one transaction; these are separate puts.
        for port in [*ports[1:], ports[0]]:
            slow = port == ports[0]
            await setup.put(
                port, at=at, waiting=40 if slow else 0, time_per_output_token=0.09 if slow else 0.03
            )
        if earlier:
            # Each record must reach a compile of its own (a burst of writes is debounced
            # into one): kvpilot reports the age of the record it holds.
            await poll(
                lambda: asyncio.to_thread(
                    lambda: (
                        metric(setup.kvpilot.api_url, "kvpilot_telemetry_age_seconds", **held)
                        >= 4.5
                    )
                ),
                15,
                "kvpilot to hold the first record",
            )
    await setup.wait_weights({ports[0]: 35, ports[1]: 100, ports[2]: 100}, 15, "slower", ring)
    assert "degraded" not in health_flags(setup.envoy, ring)[ports[0]]

    def new_sessions(count: int) -> collections.Counter[str]:
        counts: collections.Counter[str] = collections.Counter()
        with httpx.Client(timeout=10) as client:
            for index in range(count):
                response = client.post(
                    setup.url,
                    json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"x-session-id": f"session-{index}"},
                )
                counts[response.headers.get("x-backend-id", str(response.status_code))] += 1
        return counts

    counts = await asyncio.to_thread(new_sessions, 120)
    # The slow replica holds 35/235 of the ring: about 18 of 120 sessions, not 40.
    assert counts[setup.backends[0].id] <= 30, counts
    assert sum(counts.values()) == 120, counts


async def test_saturated_replicas_tighten_bounded_load_and_every_session_keeps_its_replica(
    make_setup: Callable[..., Any],
) -> None:
    usual, tight = CLUSTER + "/affinity", CLUSTER + SATURATED_SUFFIX
    twins = await affinity_twins(make_setup, (usual, tight), capacity_bound=False, max_running=8)
    setup = twins.setup

    calm = await asyncio.to_thread(twins.placement)
    assert await asyncio.to_thread(twins.served_by, usual)
    assert len(set(calm.values())) > 1, calm

    # Every batch full: session requests take the twin bounded at 100%.
    await twins.batches(8)
    await poll(lambda: asyncio.to_thread(twins.served_by, tight), 15, "the saturated twin")
    route = {"route": CLUSTER}
    assert metric(setup.kvpilot.api_url, "kvpilot_route_saturated", **route) == 1
    assert metric(setup.kvpilot.api_url, "kvpilot_route_batch_fill", **route) == 1.0
    assert metric(setup.kvpilot.api_url, "kvpilot_bounded_load_changes_total", **route) == 1
    async with httpx.AsyncClient(base_url=setup.kvpilot.api_url, headers=ADMIN) as api:
        status = (await api.get("/v1/status")).json()
    assert [
        (s["route"], s["saturated"], s["batchFill"], s["saturatedAt"]) for s in status["saturation"]
    ] == [(CLUSTER, True, 1.0, 0.8)]
    # Both twins hash the same ring: no session changes replica when the bound does.
    assert await asyncio.to_thread(twins.placement) == calm

    # Room again: back to the usual bound once the pool has been saturated for the dwell.
    await twins.batches(1)
    await poll(
        lambda: asyncio.to_thread(twins.served_by, usual), MIN_DWELL + 15, "the usual twin again"
    )
    assert metric(setup.kvpilot.api_url, "kvpilot_route_saturated", **route) == 0
    assert metric(setup.kvpilot.api_url, "kvpilot_bounded_load_changes_total", **route) == 2
    assert await asyncio.to_thread(twins.placement) == calm


async def test_the_bound_follows_the_batch_along_its_ladder_and_every_session_keeps_its_replica(
    make_setup: Callable[..., Any],
) -> None:
    usual, full, roomy = (
        CLUSTER + suffix for suffix in ("/affinity", SATURATED_SUFFIX, UNBOUNDED_SUFFIX)
    )
    twins = await affinity_twins(
        make_setup, (usual, full, roomy), capacity_bound=True, max_running=32
    )
    setup = twins.setup

    # No batch size known yet: the usual bound.
    before = await asyncio.to_thread(twins.placement)
    assert await asyncio.to_thread(twins.served_by, usual)

    # Batches of 32 full: past their usable part (100 x (32 - sqrt 32) / 32 = 82%), so 100%,
    # no replica above the mean.
    await twins.batches(32)
    await poll(lambda: asyncio.to_thread(twins.served_by, full), 15, "the 100% twin")
    route = {"route": CLUSTER}
    assert metric(setup.kvpilot.api_url, "kvpilot_route_bounded_load", **route) == 100
    async with httpx.AsyncClient(base_url=setup.kvpilot.api_url, headers=ADMIN) as api:
        status = (await api.get("/v1/status")).json()
    assert [(s["route"], s["boundedLoad"], s["fitsBatchAt"]) for s in status["saturation"]] == [
        (CLUSTER, 100, 82.322)
    ]
    assert await asyncio.to_thread(twins.placement) == before

    # 4 of 32 in flight allow 659%, past 100% per replica (three: all 12 in flight fit one
    # replica's usable batch) and past the last bound (450%, which would not bind over three
    # replicas either): the top rung, no bound, once the held peak of 32 in flight has faded
    # to where 450% fits (with the loosening margin), about 54 s, and the dwells allow. The
    # records are written again meanwhile, as a running agent keeps writing them.
    async def roomy_after_writing_again() -> bool:
        await twins.batches(4)
        return await asyncio.to_thread(twins.served_by, roomy)

    fade = PEAK_HOLD * math.log(32 / (usable_batch(32) * 100 / 495))
    # Each step up waits for its dwell too: the deadline allows three of them besides.
    await poll(roomy_after_writing_again, fade + 3 * LOOSEN_DWELL + 15, "the twin without a bound")
    assert metric(setup.kvpilot.api_url, "kvpilot_route_bounded_load", **route) == 0
    # Down to 100%, then up as the peak fades, each change at least 15 s after the last: to
    # no bound in three steps or more (125, 200, none when the rebuilds come on time).
    assert metric(setup.kvpilot.api_url, "kvpilot_bounded_load_changes_total", **route) >= 4
    assert await asyncio.to_thread(twins.placement) == before


async def test_at_batches_of_8_the_capacity_bound_takes_the_fixed_bounds_and_their_twins(
    make_setup: Callable[..., Any],
) -> None:
    """Batches of 8 are too small for the ladder (``ladder_pays``): once a record says so, the
    ladder's other twins leave Envoy, session requests take the fixed bounds' twins as those
    bounds decide (100% while every batch is full), the status says why, and no session
    changes replica."""
    usual, full, roomy = (
        CLUSTER + suffix for suffix in ("/affinity", SATURATED_SUFFIX, "/affinity-300")
    )
    twins = await affinity_twins(
        make_setup, (usual, full, roomy), capacity_bound=True, max_running=8
    )
    setup = twins.setup
    # No batch size known yet: the ladder the route asks for, at the usual bound.
    before = await asyncio.to_thread(twins.placement)
    assert await asyncio.to_thread(twins.served_by, usual)

    await twins.batches(8)
    await poll(lambda: asyncio.to_thread(twins.served_by, full), 15, "the saturated twin")
    await poll(lambda: not endpoint_weights(setup.envoy, roomy), 15, "the 300% twin gone")
    assert endpoint_weights(setup.envoy, usual) and endpoint_weights(setup.envoy, full)
    route = {"route": CLUSTER}
    assert metric(setup.kvpilot.api_url, "kvpilot_route_saturated", **route) == 1
    async with httpx.AsyncClient(base_url=setup.kvpilot.api_url, headers=ADMIN) as api:
        status = (await api.get("/v1/status")).json()
    assert [
        (s["route"], s["saturated"], s["boundedLoad"], s["ladder"], s["boundPath"])
        for s in status["saturation"]
    ] == [(CLUSTER, True, None, False, "batch 8: ladder needs > 16; fixed bounds")]
    assert metric(setup.kvpilot.api_url, "kvpilot_bounded_load_changes_total", **route) == 1
    assert await asyncio.to_thread(twins.placement) == before

    # Room again: the fixed bounds' calm twin once the dwell is over; never a ladder rung.
    await twins.batches(1)
    await poll(
        lambda: asyncio.to_thread(twins.served_by, usual), MIN_DWELL + 15, "the usual twin again"
    )
    assert not endpoint_weights(setup.envoy, roomy)
    assert metric(setup.kvpilot.api_url, "kvpilot_route_saturated", **route) == 0
    assert metric(setup.kvpilot.api_url, "kvpilot_bounded_load_changes_total", **route) == 2
    assert await asyncio.to_thread(twins.placement) == before


async def test_stale_telemetry_falls_back_to_the_static_weight(
    make_setup: Callable[..., Any],
) -> None:
    setup: Setup = await make_setup("telemetry", max_age="2s")
    ports = setup.ports
    await setup.wait_weights(dict.fromkeys(ports, 100), 30, "static weights first")
    written = time.monotonic()
    for port, waiting in zip(ports, (20, 0, 0), strict=True):
        await setup.put(port, waiting=waiting)
    await setup.wait_weights({ports[0]: 10, ports[1]: 100, ports[2]: 100}, 10, "lowered")
    # Nothing is written any more (an agent that hangs but keeps its lease): kvpilot notices
    # the age on its own and goes back to neutral, never to zero.
    await setup.wait_weights(dict.fromkeys(ports, 100), 10, "neutral after maxAge")
    # Not before the records could be stale: maxAge (2 s) after they were written. Measured
    # from the write, not from when Envoy showed the lowered weight, which a loaded machine
    # delays by more than a second.
    assert time.monotonic() - written >= 1.9
    # A record that is already old when written is neutral from the start. It is written
    # last, so once kvpilot reports its age the rebuild that saw all three has happened.
    await setup.put(ports[0], waiting=0)
    await setup.put(ports[2], waiting=0)
    await setup.put(ports[1], waiting=20, at=time.time() - 60)
    labels = {"endpoint": f"127.0.0.1:{ports[1]}", "pool": "sim"}

    async def compiled() -> bool:
        return metric(setup.kvpilot.api_url, "kvpilot_telemetry_age_seconds", **labels) >= 59

    await poll(compiled, 10, "kvpilot to read the old record")
    # The rebuild that read it decided neutral (a fresh record of 20 waiting would give 10).
    assert metric(setup.kvpilot.api_url, "kvpilot_telemetry_weight", **labels) == 100
    assert setup.weights() == dict.fromkeys(ports, 100)


async def test_telemetry_inside_the_hysteresis_band_causes_no_push(
    make_setup: Callable[..., Any],
) -> None:
    setup: Setup = await make_setup("telemetry")
    ports = setup.ports
    api_url = setup.kvpilot.api_url
    await setup.wait_weights(dict.fromkeys(ports, 100), 30, "static weights first")
    for port in ports:
        await setup.put(port, waiting=0, kv_cache=0.1)

    async def settled() -> bool:
        return (
            metric(
                api_url, "kvpilot_telemetry_weight", endpoint=f"127.0.0.1:{ports[2]}", pool="sim"
            )
            == 100
        )

    await poll(settled, 10, "the telemetry to be compiled")
    pushes = metric(api_url, "kvpilot_snapshot_pushes_total", cause="telemetry")
    versions = setup.envoy.config_dump(include_eds=True)
    builds = metric(api_url, "kvpilot_reconcile_builds_total", path="fast")
    # Noise: one request queued now and then, KV cache wobbling by a few percent.
    for waiting, kv in ((1, 0.12), (0, 0.08), (1, 0.15), (0, 0.1)):
        await setup.put(ports[0], waiting=waiting, kv_cache=kv)

        async def rebuilt(after: float = builds) -> float:
            now = metric(api_url, "kvpilot_reconcile_builds_total", path="fast")
            return now if now > after else 0.0

        builds = await poll(rebuilt, 10, "kvpilot to process the telemetry")
    assert metric(api_url, "kvpilot_snapshot_pushes_total", cause="telemetry") == pushes
    assert setup.weights() == dict.fromkeys(ports, 100)
    assert _eds_versions(setup.envoy.config_dump(include_eds=True)) == _eds_versions(versions)
    # Leaving the band is pushed.
    await setup.put(ports[0], waiting=20, kv_cache=0.1)
    await setup.wait_weights({ports[0]: 10, ports[1]: 100, ports[2]: 100}, 10, "outside band")
    assert metric(api_url, "kvpilot_snapshot_pushes_total", cause="telemetry") == pushes + 1
    assert metric(api_url, "kvpilot_telemetry_weight_changes_total", pool="sim") >= 1


def eds_ports(envoy: EmbeddedEnvoy, cluster: str) -> set[int]:
    """Ports of the endpoints in `cluster`'s ClusterLoadAssignment as Envoy received it."""
    ports = set()
    for config in envoy.config_dump(include_eds=True).get("configs", []):
        for dynamic in config.get("dynamic_endpoint_configs", []):
            assignment = dynamic.get("endpoint_config", {})
            if assignment.get("cluster_name") != cluster:
                continue
            for group in assignment.get("endpoints", []):
                for lb_endpoint in group.get("lb_endpoints", []):
                    address = lb_endpoint["endpoint"]["address"]["socket_address"]
                    ports.add(int(address["port_value"]))
    return ports


def _eds_versions(dump: dict[str, Any]) -> list[str]:
    out = []
    for config in dump.get("configs", []):
        for cluster in config.get("dynamic_endpoint_configs", []):
            out.append(cluster.get("version_info", ""))
    return out


async def test_a_killed_agents_endpoint_leaves_eds_after_the_lease_ttl(
    make_setup: Callable[..., Any], etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    setup: Setup = await make_setup("telemetry", static=False)
    processes = []
    for backend in setup.backends[:2]:
        processes.append(await start_agent_process(etcd.endpoint, etcd_prefix, "sim", backend.url))
    kept, killed = setup.ports[0], setup.ports[1]
    try:
        await setup.wait_weights({kept: 100, killed: 100}, 30, "agents register their backends")
        processes[1].send_signal(signal.SIGKILL)
        await processes[1].wait()
        started = time.monotonic()

        seen: list[set[int]] = [set()]

        async def left_eds() -> bool:
            seen[0] = await asyncio.to_thread(eds_ports, setup.envoy, CLUSTER)
            return seen[0] == {kept}

        try:
            await poll(left_eds, 30, "the killed agent's endpoint to leave EDS")
        except AssertionError as error:
            keys, _ = await setup.store.client.get_prefix(setup.store.keys.absolute(""))
            left = [kv.key for kv in keys]
            raise AssertionError(f"{error}: EDS has {seen[0]}, {kept=}, etcd has {left}") from None
        took = time.monotonic() - started
        print(f"the endpoint left EDS {took:.2f}s after its agent was killed (2 s lease)")
        # Envoy keeps a host that left EDS while it still passes active health checks (its
        # eventual-consistency rule), so the backend, still alive here, leaves rotation once
        # it fails them.
        setup.backends[1].status = 503
        await setup.wait_weights({kept: 100}, 15, "the host to leave Envoy")
        counts = await asyncio.to_thread(served_by, setup.url, 10)
        assert counts == collections.Counter({"be-0": 10}), counts
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def test_orca_mode_follows_the_utilization_backends_report(
    make_setup: Callable[..., Any],
) -> None:
    setup: Setup = await make_setup("orca")
    for backend, utilization in zip(setup.backends, (0.9, 0.1, 0.45), strict=True):
        backend.utilization = utilization
    # kvpilot sends neutral weights and lets Envoy weigh by the reports. Envoy's own view
    # shows the balancer's weights: it rewrites every host's weight once per second, to 1
    # while no host has a valid report, so the weights sent are read from kvpilot.
    await poll(
        lambda: asyncio.to_thread(lambda: set(setup.weights()) == set(setup.ports)),
        30,
        "endpoints in Envoy",
    )
    sent = await sent_endpoint_weights(f"127.0.0.1:{setup.kvpilot.xds_port}", CLUSTER)
    assert sent == dict.fromkeys(setup.ports, 100), sent
    dump = setup.envoy.config_dump()
    assert "client_side_weighted_round_robin" in str(dump)
    # Envoy ignores a host's reports for the 1 s blackout period, then weighs hosts by
    # qps / utilization. Send traffic until the split settles, then measure it.
    await asyncio.to_thread(served_by, setup.url, 60)

    # The weights feed back on the traffic they shape, so a window can catch them mid-way:
    # poll whole windows until one shows the settled split (be-0 expected at about 8%).
    last: list[collections.Counter[str]] = []

    async def follows() -> collections.Counter[str] | None:
        counts = await asyncio.to_thread(served_by, setup.url, 200)
        last[:] = [counts]
        ordered = counts["be-1"] > counts["be-2"] > counts["be-0"]
        settled = counts["be-1"] >= 100 and counts["be-0"] <= 40
        return counts if ordered and settled else None

    try:
        await poll(follows, 45, "traffic to follow the reported utilization")
    except AssertionError as error:
        raise AssertionError(f"{error}: last window {last}") from None
