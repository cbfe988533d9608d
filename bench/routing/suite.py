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
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from api.client import KvpilotClient
from bench.rig.loadgen import RunResult
from bench.rig.stack import MODEL, start_agent
from bench.rig.workload import Workload, oracle_hit_rate
from bench.routing.fleets import (
    Fleet,
    bound_changes,
    idle,
    kvpilot_weights,
    policy_body,
    pool_body,
    prepare,
    replica_metrics,
    say,
    serves,
    wait_for,
)
from bench.routing.measure import measure, summary_line, weight_moves
from bench.routing.replay import replay_all, start_workers
from bench.routing.report import Workloads, write_suite_report
from bench.routing.results import Calibration, ScenarioWorkload, SuiteResults, Timeline
from bench.routing.scenarios import (
    SCENARIOS,
    SUITE_POLICIES,
    Scenario,
    SuiteConfig,
    batch_key,
    default_suite,
    sim_at,
)
from bench.routing.sequential import RoutingConfig, calibrate
from controlplane.local import ManagedProcess, free_port, local_stack
from controlplane.local.process import LauncherError
from controlplane.local.replicas import BackendProcess

# --------------------------------------------------------------------------- the run


def run_suite(config: SuiteConfig, state_dir: Path | None = None) -> Path:
    """Run every scenario with every seed; returns the Markdown report's path."""

    policies = [p for p in SUITE_POLICIES if p.key in config.policies]
    results: SuiteResults = {}
    workloads: Workloads = {}
    with contextlib.ExitStack() as exits:
        if state_dir is None:
            state_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvsuite-")))
        say("starting etcd, kvpilot and Envoy ...")
        fastest = min(sim_at(config.sim, batch).time_scale for batch in config.batch_sizes)
        local = exits.enter_context(
            local_stack(
                state_dir,
                node_id="bench-envoy",
                etcd_args=["--unsafe-no-fsync"],
                # kvpilot's cap of one telemetry push a second, in simulated time as in real
                # time: at a time scale of 0.5 a wall-clock second would be two simulated ones.
                kvpilot_args=["--telemetry-push-interval", f"{fastest:g}"],
            )
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
        pool = exits.enter_context(start_workers(len(policies)))
        number = 0
        stamp = time.strftime("%Y%m%d-%H%M%S")
        pools: dict[str, str] = {}
        # Seed by seed, every batch size each time (with fleets of its own), every scenario
        # each time, and the report rewritten after every run: a run stopped early still
        # reports every scenario at every batch size.
        for seed in config.seeds:
            for batch in config.batch_sizes:
                at_batch = replace(config, sim=sim_at(config.sim, batch))
                with contextlib.ExitStack() as running:
                    say(f"\n=== seed {seed}, batch size {batch}: a fleet of replicas per policy")
                    fleets = []
                    for policy in policies:
                        backends = running.enter_context(
                            _start_fleet(policy.key, at_batch, state_dir)
                        )
                        # The pool of the fleets before, so that the next run deletes it.
                        old = pools.get(policy.key, "")
                        fleets.append(Fleet(policy, backends, free_port(), old))
                    for scenario in config.scenarios:
                        number += 1
                        active = [f for f in fleets if f.policy.runs_in(scenario.key)]
                        _run_scenario(
                            pool, local, client, active, scenario, seed, at_batch, number,
                            state_dir, batch_key(scenario.key, batch), results, workloads,
                        )  # fmt: skip
                        write_suite_report(config, policies, workloads, results, stamp)
                    pools = {fleet.policy.key: fleet.pool for fleet in fleets}
    return write_suite_report(config, policies, workloads, results, stamp)


def _start_fleet(key: str, config: SuiteConfig, state_dir: Path) -> BackendProcess:
    """One policy's replicas, started; a start that lost a port to another process on the
    machine (the replicas pick free ports, which a neighbour may take first) is tried again."""
    for attempt in range(3):
        backends = BackendProcess(
            config.replicas,
            id_prefix=key,
            model=MODEL,
            state_dir=state_dir / "backends",
            simulator=config.sim,
        )
        try:
            return backends.start()
        except LauncherError:
            if attempt == 2:
                raise
            say(f"   {key}'s replicas did not start; trying again")
    raise AssertionError("unreachable")


def _run_scenario(
    pool: concurrent.futures.ProcessPoolExecutor,
    local: Any,
    client: KvpilotClient,
    fleets: Sequence[Fleet],
    scenario: Scenario,
    seed: int,
    config: SuiteConfig,
    number: int,
    state_dir: Path,
    key: str,
    results: SuiteResults,
    workloads: Workloads,
) -> None:
    """One scenario with one seed through every fleet; its numbers go into `results` and
    `workloads` under `key`. `config.sim` is the replicas' at this batch size."""
    workload, calibration = _calibrate(config, scenario, seed)
    prompts = workload.system_prompts()
    oracle = oracle_hit_rate(workload, config.sim.block_size, prompts)
    summary = workload.summary()
    workloads.setdefault(key, []).append(ScenarioWorkload(summary, calibration, oracle))
    say(
        f"\n== {scenario.title}, batch size {config.sim.max_batch}, seed {seed}: "
        f"{summary.requests} requests, {summary.sessions} sessions, "
        f"{summary.document_requests} document requests, oracle hit rate {oracle:.1%}"
    )
    runs, timelines, bounds = _run_once(
        pool, local, client, fleets, scenario, workload, config, number, state_dir
    )
    for fleet in fleets:
        measured = measure(
            runs[fleet.policy.key],
            replica_metrics(fleet),
            scenario,
            fleet.policy.key,
            oracle,
            config.slo_ttft,
            config.ramp,
            seed=seed,
            batch=config.sim.max_batch,
        )
        timeline = timelines.get(fleet.policy.key)
        measured = replace(
            measured,
            bound_changes=bounds.get(fleet.policy.key),
            weights=None if timeline is None else weight_moves(timeline, scenario.event),
            weight_timeline=timeline,
        )
        results.setdefault(key, {}).setdefault(fleet.policy.key, []).append(measured)
        say(f"   {fleet.policy.key:>16}: {summary_line(measured)}")


def _calibrate(config: SuiteConfig, scenario: Scenario, seed: int) -> tuple[Workload, Calibration]:
    """The scenario's workload at its offered load of the fleet's capacity."""
    capacity = scenario.capacity(config.replicas)
    bench = RoutingConfig(
        replicas=config.replicas,
        sim=config.sim,
        target_load=scenario.load * capacity / config.replicas,
        # Capacity is what a replica serves with full batches: round robin's ceiling.
        capacity_batch=config.sim.max_batch,
    )
    workload, calibration = calibrate(bench, replace(scenario.workload, seed=seed))
    offered = calibration.estimated_cache_blind_load * (config.replicas / capacity)
    return workload, replace(calibration, offered_load=offered)


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
) -> tuple[dict[str, RunResult], dict[str, Timeline], dict[str, float]]:
    """One workload through every fleet at once; with the replays' results and kvpilot's
    weights over time, how often each capacity-bound fleet's session requests changed their
    bounded load (route updates) during the replay. Each run gets fresh pool names, so
    kvpilot starts it with no memory of the last one (telemetry, hysteresis)."""
    begun = time.monotonic()
    old = [fleet.pool for fleet in fleets if fleet.pool]
    interval = config.agent_interval * config.sim.time_scale
    for fleet in fleets:
        fleet.pool = f"run{number}-{fleet.policy.key.replace('_', '-')}"
        client.put(pool_body(fleet, scenario, agent_interval=interval))
        client.put(policy_body(fleet))
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
                        interval=interval,
                        max_running=config.sim.max_batch,
                    )
                )
        for fleet in fleets:
            wait_for(lambda f=fleet: serves(f), 60, f"Envoy to serve {fleet.policy.key}")
            wait_for(lambda f=fleet: idle(f), 120, f"{fleet.policy.key}'s replicas to go idle")
            if fleet.telemetry:
                wait_for(
                    lambda f=fleet: (
                        len(kvpilot_weights(local.kvpilot.api_url, f.pool)) >= len(f.replicas)
                    ),
                    30,
                    f"kvpilot to weigh {fleet.pool} by telemetry",
                )
        prompts = workload.system_prompts()

        async def prepare_all() -> None:
            await asyncio.gather(*(prepare(f, scenario, config.sim, prompts) for f in fleets))

        ready = time.monotonic()
        asyncio.run(prepare_all())
        warm = time.monotonic()
        before = bound_changes(local.kvpilot.api_url)
        runs, timelines = replay_all(
            pool, fleets, workload, scenario, config, local.kvpilot.api_url
        )
        after = bound_changes(local.kvpilot.api_url)
        bounds = {
            fleet.policy.key: after.get(route, 0.0) - before.get(route, 0.0)
            for fleet in fleets
            if fleet.telemetry
            and (route := f"{policy_body(fleet)['metadata']['name']}/llm") in after
        }
        say(
            f"   wall time: {ready - begun:.1f}s to configure, {warm - ready:.1f}s to warm the "
            f"caches, {time.monotonic() - warm:.1f}s to replay"
        )
        return runs, timelines, bounds
    finally:
        for agent in agents:
            agent.stop()


__all__ = ["SCENARIOS", "SUITE_POLICIES", "Scenario", "SuiteConfig", "default_suite", "run_suite"]
