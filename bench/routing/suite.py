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
from bench.routing.measure import Timeline, measure, summary_line, weight_moves
from bench.routing.replay import replay_all, start_workers
from bench.routing.report import write_suite_report
from bench.routing.scenarios import SCENARIOS, SUITE_POLICIES, Scenario, SuiteConfig, default_suite
from bench.routing.sequential import RoutingConfig, calibrate
from controlplane.local import ManagedProcess, free_port, local_stack
from controlplane.local.replicas import BackendProcess

# --------------------------------------------------------------------------- the run


def run_suite(config: SuiteConfig, state_dir: Path | None = None) -> Path:
    """Run every scenario with every seed; returns the Markdown report's path."""

    policies = [p for p in SUITE_POLICIES if p.key in config.policies]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    workloads: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as exits:
        if state_dir is None:
            state_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvsuite-")))
        say("starting etcd, kvpilot, Envoy and one fleet of simulated replicas per policy ...")
        local = exits.enter_context(
            local_stack(
                state_dir,
                node_id="bench-envoy",
                etcd_args=["--unsafe-no-fsync"],
                # kvpilot's cap of one telemetry push a second, in simulated time as in real
                # time: at a time scale of 0.5 a wall-clock second would be two simulated ones.
                kvpilot_args=["--telemetry-push-interval", f"{config.sim.time_scale:g}"],
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
                say(
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
                        replica_metrics(fleet),
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
                    say(f"   {fleet.policy.key:>14}: {summary_line(measured)}")
                write_suite_report(config, policies, workloads, results, stamp)
    return write_suite_report(config, policies, workloads, results, stamp)


def _calibrate(
    config: SuiteConfig, scenario: Scenario, seed: int
) -> tuple[Workload, dict[str, Any]]:
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
        client.put(pool_body(fleet))
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
                        interval=config.agent_interval * config.sim.time_scale,
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
        runs, timelines = replay_all(
            pool, fleets, workload, scenario, config, local.kvpilot.api_url
        )
        say(
            f"   wall time: {ready - begun:.1f}s to configure, {warm - ready:.1f}s to warm the "
            f"caches, {time.monotonic() - warm:.1f}s to replay"
        )
        return runs, timelines
    finally:
        for agent in agents:
            agent.stop()


__all__ = ["SCENARIOS", "SUITE_POLICIES", "Scenario", "SuiteConfig", "default_suite", "run_suite"]
