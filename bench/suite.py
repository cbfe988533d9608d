"""The scenario suite: every routing policy side by side, at once, through one real Envoy.

Each policy gets its own fleet of simulated vLLM replicas (one process per policy), its own
pool and its own listener on one Envoy configured by kvpilot; the load generator replays the
same workload to every listener at the same time. So the policies share whatever the machine
does to them (a neighbour's build, a slow second) and their numbers are compared within one
run, never across runs. ``--policies ...,affinity_copy`` runs "affinity alone" twice: the gap
between the two copies is the noise of a run, the yardstick for every other difference.

Scenarios (8 replicas by default; load is a share of the fleet's estimated cache-blind
capacity, the capacity round robin has):

- ``chat``: multi-turn chat at 75%;
- ``mix``: chat plus shared documents whose popularity follows Zipf's law, at 75%;
- ``overload``: chat at 110%;
- ``hetero``: 2 of 8 replicas at half speed and one with half the KV cache, at 75% of what
  this smaller fleet can do;
- ``slowdown``: one replica runs 3x slower for a while in the middle of the run, then
  recovers (a noisy neighbour);
- ``bursty``: chat at 75% with bursty arrivals (gamma gaps, coefficient of variation 2).

Every scenario runs with several seeds (each a different workload); the report shows the
median and the spread (min to max) of every number, and checks the issue's targets on the
medians.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from api.client import KvpilotClient
from bench.backend import BackendProcess, ReplicaInfo
from bench.loadgen import RunResult, parse_metrics, replay
from bench.routing import BenchConfig, calibrate
from bench.scenarios import (
    SCENARIOS,
    SUITE_POLICIES,
    Scenario,
    SlowEvent,
    SuiteConfig,
    SuitePolicy,
    default_suite,
)
from bench.simulator import SimConfig
from bench.stack import MODEL, start_agent
from bench.suite_measure import Timeline, measure, summary_line, weight_moves
from bench.suite_report import write_suite_report
from bench.workload import Workload, oracle_hit_rate
from controlplane.launchers import ManagedProcess, free_port, local_stack

# --------------------------------------------------------------------------- the stack


def _say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Fleet:
    """One policy's replicas, listener and (per run) pool."""

    policy: SuitePolicy
    backends: BackendProcess
    port: int
    pool: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    @property
    def replicas(self) -> list[ReplicaInfo]:
        return self.backends.replicas

    @property
    def telemetry(self) -> bool:
        return self.policy.route.get("balancing") == "telemetry"


def _pool_body(fleet: Fleet) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Pool",
        "metadata": {"name": fleet.pool},
        "spec": {
            "models": [MODEL],
            # Named alike in every fleet: each ring places replica i at the same points, so
            # every policy sends a session to the same replica index and fleets compare.
            "endpoints": [
                {"address": r.host, "port": r.port, "name": f"replica-{index}"}
                for index, r in enumerate(fleet.replicas)
            ],
            "healthCheck": {"path": "/health", "interval": "1s", "timeout": "500ms"},
            "telemetry": {"format": "vllm", "maxAge": "5s"},
        },
    }


def _policy_body(fleet: Fleet) -> dict[str, Any]:
    route = {"name": "llm", "match": {"pathPrefix": "/v1/"}, "tiers": [[fleet.pool]]}
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": f"bench-{fleet.policy.key.replace('_', '-')}"},
        "spec": {
            "listener": {"address": "127.0.0.1", "port": fleet.port},
            "routes": [{**route, **fleet.policy.route}],
        },
    }


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if predicate():
                return
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def _serves(fleet: Fleet) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    response = httpx.post(fleet.url, json=body, timeout=10.0)
    return response.status_code == 200 and response.headers.get("x-backend-id", "").startswith(
        fleet.policy.key + "-"
    )


def _weights(api_url: str, pool: str) -> dict[str, float]:
    """kvpilot's telemetry weights for `pool`, by endpoint."""
    out = {}
    for line in httpx.get(f"{api_url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith("kvpilot_telemetry_weight{") and f'pool="{pool}"' in line:
            name, _, value = line.rpartition(" ")
            out[name.split('endpoint="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def _metrics(fleet: Fleet) -> dict[str, dict[str, float]]:
    return {
        r.id: parse_metrics(httpx.get(f"{r.url}/metrics", timeout=5.0).text) for r in fleet.replicas
    }


def _idle(fleet: Fleet) -> bool:
    return all(
        m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0
        for m in _metrics(fleet).values()
    )


async def _admin(
    url: str, path: str, body: dict[str, Any], client: httpx.AsyncClient | None = None
) -> None:
    if client is not None:
        (await client.post(f"{url}{path}", json=body, timeout=30.0)).raise_for_status()
        return
    async with httpx.AsyncClient(timeout=10.0) as own:
        (await own.post(f"{url}{path}", json=body)).raise_for_status()


async def _prepare(fleet: Fleet, scenario: Scenario, sim: SimConfig, prompts: list[str]) -> None:
    """Give every replica the scenario's speed and cache, holding the shared system prompts
    (put in its cache directly: a fleet in service holds them, and serving them as requests
    took half a minute of wall time per run on a loaded machine)."""
    preload = [{"messages": [{"role": "system", "content": prompt}]} for prompt in prompts]
    # One client for the fleet: a client each costs a TLS context, a second on a busy machine.
    async with httpx.AsyncClient() as client:
        for index, replica in enumerate(fleet.replicas):
            blocks = max(1, round(sim.kv_blocks * scenario.kv_of(index)))
            reset = {"kv_blocks": blocks, "preload": preload}
            await _admin(replica.url, "/admin/reset", reset, client)
            await _admin(replica.url, "/admin/slow", {"factor": scenario.slow_of(index)}, client)


async def _events(
    event: SlowEvent, replicas: Sequence[tuple[str, str]], started: float, scale: float
) -> None:
    """Slow one replica of a fleet from ``event.start`` to ``event.end`` (simulated seconds
    after the replay's ``started``, a ``time.monotonic()`` moment), and recover it."""
    url = replicas[event.replica][1]
    await asyncio.sleep(max(0.0, started + event.start * scale - time.monotonic()))
    await _admin(url, "/admin/slow", {"factor": event.factor})
    try:
        await asyncio.sleep(max(0.0, started + event.end * scale - time.monotonic()))
    finally:
        await _admin(url, "/admin/slow", {"factor": 1.0})


def _replay_process(
    workload: Workload,
    url: str,
    replicas: list[tuple[str, str]],
    start_at: float,
    time_scale: float,
    deadline: float,
    event: SlowEvent | None,
    stop_at: float | None,
) -> RunResult:
    """One fleet's replay, in a process of its own, from the wall-clock moment `start_at`.

    A load generator is Python too: one process for every fleet would make it the
    bottleneck of all of them on a busy machine. One process per fleet, started at the same
    instant, keeps the fleets independent and the comparison fair.
    """

    async def run() -> RunResult:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        late = time.time() - start_at
        # The slowdown runs in the replay's own loop and on the replay's clock, so it falls
        # where the report's windows expect it.
        slowing: list[asyncio.Task[None]] = []

        def start_events(started: float) -> None:
            if event is not None:
                slowing.append(asyncio.create_task(_events(event, replicas, started, time_scale)))

        result = await replay(
            workload,
            url,
            model=MODEL,
            time_scale=time_scale,
            replicas=replicas,
            deadline=deadline,
            sample_interval=1.0,
            on_start=start_events,
            stop_at=stop_at,
        )
        result.late = late
        for task in slowing:
            task.cancel()
        await asyncio.gather(*slowing, return_exceptions=True)
        return result

    return asyncio.run(run())


def _ready(seconds: float) -> int:
    """A task that holds one worker for a moment: once one has run per worker, every worker
    process has started and imported the bench, including what httpx imports only when a
    client is first made (seconds on a loaded machine, which would delay the first requests
    behind the replay's schedule)."""

    async def client() -> None:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport()):
            pass

    asyncio.run(client())
    time.sleep(seconds)
    return os.getpid()


def start_workers(count: int) -> concurrent.futures.ProcessPoolExecutor:
    """The load generators' processes, started and warm before any replay: a process that
    is still importing when its replay should begin would start its fleet late."""
    pool = concurrent.futures.ProcessPoolExecutor(
        count, mp_context=multiprocessing.get_context("spawn")
    )
    pids = set(pool.map(_ready, [0.5] * count))
    while len(pids) < count:
        pids |= set(pool.map(_ready, [0.5] * count))
    return pool


def _replay_all(
    pool: concurrent.futures.ProcessPoolExecutor,
    fleets: Sequence[Fleet],
    workload: Workload,
    scenario: Scenario,
    config: SuiteConfig,
    api_url: str,
) -> tuple[dict[str, RunResult], dict[str, Timeline]]:
    """Every fleet's replay at once; and, while they run, the weights kvpilot gives the
    replicas of each telemetry fleet (twice a second of wall time), to see when they move."""
    scale = config.sim.time_scale
    start_at = time.time() + 2.0
    futures = [
        pool.submit(
            _replay_process,
            workload,
            fleet.url,
            [(r.id, r.url) for r in fleet.replicas],
            start_at,
            scale,
            config.deadline,
            scenario.event,
            # Without a ramp (the smoke run) every turn is sent: the fleets replay the same
            # requests, which the smoke test checks.
            scenario.workload.duration if config.ramp else None,
        )
        for fleet in fleets
    ]
    timelines: dict[str, Timeline] = {f.policy.key: [] for f in fleets if f.telemetry}
    while not all(future.done() for future in futures):
        for fleet in fleets:
            if fleet.telemetry:
                with contextlib.suppress(httpx.HTTPError):
                    weights = _weights(api_url, fleet.pool)
                    at = (time.time() - start_at) / scale
                    timelines[fleet.policy.key].append(
                        (at, [weights.get(f"{r.host}:{r.port}", 0.0) for r in fleet.replicas])
                    )
        concurrent.futures.wait(futures, timeout=0.5)
    results = [future.result() for future in futures]
    for fleet, run in zip(fleets, results, strict=True):
        if run.late > 0.5:
            _say(f"   warning: {fleet.policy.key}'s load generator started {run.late:.1f}s late")
    runs = {fleet.policy.key: run for fleet, run in zip(fleets, results, strict=True)}
    return runs, timelines


# --------------------------------------------------------------------------- the run


def run_suite(config: SuiteConfig, state_dir: Path | None = None) -> Path:
    """Run every scenario with every seed; returns the Markdown report's path."""

    policies = [p for p in SUITE_POLICIES if p.key in config.policies]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    workloads: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as exits:
        if state_dir is None:
            state_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvsuite-")))
        _say("starting etcd, kvpilot, Envoy and one fleet of simulated replicas per policy ...")
        local = exits.enter_context(
            local_stack(state_dir, node_id="bench-envoy", etcd_args=["--unsafe-no-fsync"])
        )
        client = KvpilotClient(local.kvpilot.api_url, token=local.admin_token)
        client.put(
            {
                "apiVersion": "kvpilot.io/v1",
                "kind": "Fleet",
                "metadata": {"name": "default"},
                "spec": {"accessLog": False},
            }
        )
        fleets = []
        for policy in policies:
            backends = BackendProcess(
                config.replicas,
                id_prefix=policy.key,
                model=MODEL,
                state_dir=state_dir / "backends",
                simulator=config.sim,
            )
            exits.enter_context(backends.start())
            fleets.append(Fleet(policy, backends, free_port()))
        pool = exits.enter_context(start_workers(len(fleets)))
        number = 0
        stamp = time.strftime("%Y%m%d-%H%M%S")
        # Seed by seed, every scenario each time, and the report rewritten after every run:
        # a run stopped early still reports every scenario.
        for seed in config.seeds:
            for scenario in config.scenarios:
                number += 1
                workload, calibration = _calibrate(config, scenario, seed)
                prompts = workload.system_prompts()
                oracle = oracle_hit_rate(workload, config.sim.block_size, prompts)
                summary = {**workload.summary(), **calibration, "oracle_hit_rate": oracle}
                workloads.setdefault(scenario.key, []).append(summary)
                _say(
                    f"\n== {scenario.title}, seed {seed}: {summary['requests']} requests, "
                    f"{summary['sessions']} sessions, {summary['document_requests']} document "
                    f"requests, oracle hit rate {oracle:.1%}"
                )
                runs, timelines = _run_once(
                    pool, local, client, fleets, scenario, workload, config, number, state_dir
                )
                for fleet in fleets:
                    measured = measure(
                        runs[fleet.policy.key],
                        _metrics(fleet),
                        scenario,
                        fleet.policy.key,
                        oracle,
                        config.slo_ttft,
                        config.ramp,
                    )
                    measured["seed"] = seed
                    if fleet.policy.key in timelines:
                        timeline = timelines[fleet.policy.key]
                        measured["weights"] = weight_moves(timeline, scenario.event)
                        measured["weight_timeline"] = timeline
                    results.setdefault(scenario.key, {}).setdefault(fleet.policy.key, []).append(
                        measured
                    )
                    _say(f"   {fleet.policy.key:>14}: {summary_line(measured)}")
                write_suite_report(config, policies, workloads, results, stamp)
    return write_suite_report(config, policies, workloads, results, stamp)


def _calibrate(
    config: SuiteConfig, scenario: Scenario, seed: int
) -> tuple[Workload, dict[str, Any]]:
    """The scenario's workload at its offered load of the fleet's capacity."""
    capacity = scenario.capacity(config.replicas)
    bench = BenchConfig(
        replicas=config.replicas,
        sim=config.sim,
        target_load=scenario.load * capacity / config.replicas,
        # Capacity is what a replica serves with full batches: round robin's ceiling.
        capacity_batch=config.sim.max_batch,
    )
    workload, calibration = calibrate(bench, replace(scenario.workload, seed=seed))
    calibration["offered_load"] = calibration["estimated_cache_blind_load"] * (
        config.replicas / capacity
    )
    return workload, calibration


def _run_once(
    pool: concurrent.futures.ProcessPoolExecutor,
    local: Any,
    client: KvpilotClient,
    fleets: Sequence[Fleet],
    scenario: Scenario,
    workload: Workload,
    config: SuiteConfig,
    number: int,
    state_dir: Path,
) -> tuple[dict[str, RunResult], dict[str, Timeline]]:
    """One workload through every fleet at once. Each run gets fresh pool names, so kvpilot
    starts it with no memory of the last one (telemetry, hysteresis)."""
    begun = time.monotonic()
    old = [fleet.pool for fleet in fleets if fleet.pool]
    for fleet in fleets:
        fleet.pool = f"run{number}-{fleet.policy.key.replace('_', '-')}"
        client.put(_pool_body(fleet))
        client.put(_policy_body(fleet))
    for name in old:
        client.delete("pools", name)
    agents: list[ManagedProcess] = []
    try:
        for fleet in fleets:
            if fleet.telemetry:
                agents.append(
                    start_agent(
                        state_dir / f"agent-{number}-{fleet.policy.key}",
                        local.etcd.endpoint,
                        [r.url for r in fleet.replicas],
                        pool=fleet.pool,
                        interval=config.agent_interval * config.sim.time_scale,
                        max_running=config.sim.max_batch,
                    )
                )
        for fleet in fleets:
            _wait(lambda f=fleet: _serves(f), 60, f"Envoy to serve {fleet.policy.key}")
            _wait(lambda f=fleet: _idle(f), 120, f"{fleet.policy.key}'s replicas to go idle")
            if fleet.telemetry:
                _wait(
                    lambda f=fleet: len(_weights(local.kvpilot.api_url, f.pool)) >= len(f.replicas),
                    30,
                    f"kvpilot to weigh {fleet.pool} by telemetry",
                )
        prompts = workload.system_prompts()

        async def prepare() -> None:
            await asyncio.gather(*(_prepare(f, scenario, config.sim, prompts) for f in fleets))

        ready = time.monotonic()
        asyncio.run(prepare())
        warm = time.monotonic()
        runs, timelines = _replay_all(
            pool, fleets, workload, scenario, config, local.kvpilot.api_url
        )
        _say(
            f"   wall time: {ready - begun:.1f}s to configure, {warm - ready:.1f}s to warm the "
            f"caches, {time.monotonic() - warm:.1f}s to replay"
        )
        return runs, timelines
    finally:
        for agent in agents:
            agent.stop()


__all__ = ["SCENARIOS", "SUITE_POLICIES", "Scenario", "SuiteConfig", "default_suite", "run_suite"]
