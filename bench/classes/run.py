"""The service-class benchmark's runs: one stack, the reference and each policy in turn,
the same requests replayed to each (see `bench.classes.config` for what is run)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import pickle
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from bench.classes.config import (
    BATCH,
    LANE_POOL,
    POLICIES,
    REFERENCE,
    ClassesCalibration,
    ClassesConfig,
    build_workloads,
    lane_route,
)
from bench.classes.report import engine_phases, markdown, summarize, targets
from bench.classes.results import PolicyRun
from bench.classes.signals import SignalSampler, lead_table
from bench.rig.loadgen import replay
from bench.rig.report import num
from bench.rig.routes import Policy
from bench.rig.stack import (
    MODEL,
    POOL,
    Stack,
    apply_policy,
    put_pool,
    ready_for_replay,
    replica_metrics,
    start_agent,
    start_stack,
)
from bench.rig.workload import Workload
from bench.routing.sequential import RoutingConfig
from controlplane.local import LauncherError, wait_until


def _apply(stack: Stack, policy: Policy, config: ClassesConfig) -> None:
    """Apply `policy` (its pools first, with a batch lane if it has one) and wait until
    Envoy serves it."""
    service_classes = config.service_classes.get(policy.key)
    spec: dict[str, Any] = {} if service_classes is None else {"serviceClasses": service_classes}
    replicas = len(stack.backends.replicas)
    lane = config.lanes.get(policy.key, 0)
    put_pool(stack, POOL, range(replicas - lane))
    if lane:
        put_pool(stack, LANE_POOL, range(replicas - lane, replicas))
        sizes = {POOL: replicas - lane, LANE_POOL: lane}
        before = [lane_route(policy.route)]
        apply_policy(stack, policy.key, policy.route, before=before, pools=sizes, **spec)
    else:
        apply_policy(stack, policy.key, policy.route, **spec)
    classified = service_classes is not None
    wait_until(
        lambda: _classes_in_envoy(stack) == classified, 60, f"Envoy's routes for {policy.key}"
    )


def _classes_in_envoy(stack: Stack) -> bool:
    """True when Envoy's route configuration has per-class entries."""
    with contextlib.suppress(Exception):
        for config in stack.envoy.config_dump()["configs"]:
            for entry in config.get("dynamic_route_configs", []):
                if "@batch" in json.dumps(entry.get("route_config", {})):
                    return True
    return False


def _all_admitted(stack: Stack) -> bool:
    """True when kvpilot admits every class in full (or has no service classes)."""
    text = httpx.get(f"{stack.kvpilot.api_url}/metrics", timeout=5).text
    return all(
        float(line.rpartition(" ")[2]) == 1.0
        for line in text.splitlines()
        if line.startswith("kvpilot_admission_admitted_ratio{")
    )


@contextlib.contextmanager
def _lane_agent(stack: Stack, config: ClassesConfig, lane: int) -> Iterator[None]:
    """A second `kvpilot agent` while a batch lane runs: the lane's replicas' telemetry under
    the lane's pool, which its route's admission reads (the stack's agent writes every
    replica under the main pool)."""
    if not lane:
        yield
        return
    sim = config.routing.sim
    agent = start_agent(
        stack.state_dir / "lane-agent",
        stack.etcd_endpoint,
        [replica.url for replica in stack.backends.replicas[-lane:]],
        pool=LANE_POOL,
        interval=config.routing.agent_interval * sim.time_scale,
        max_running=sim.max_batch,
    )
    try:
        yield
    finally:
        agent.stop()


def run_one(stack: Stack, policy: Policy, workload: Workload, config: ClassesConfig) -> PolicyRun:
    print(f"\n== {policy.title}: {workload.requests} requests", flush=True)
    with _lane_agent(stack, config, config.lanes.get(policy.key, 0)):
        return _run_one(stack, policy, workload, config)


def _run_one(stack: Stack, policy: Policy, workload: Workload, config: ClassesConfig) -> PolicyRun:
    sim = config.routing.sim
    _apply(stack, policy, config)
    ready_for_replay(stack, workload.system_prompts(), idle_timeout=120)
    # Warming prefills every long system prompt at once, which saturates the pool for a
    # moment: start only once admission has taken every class back.
    wait_until(lambda: _all_admitted(stack), 60, "admission to readmit every class")
    replicas = [(r.id, r.url) for r in stack.backends.replicas]
    with SignalSampler(
        stack.kvpilot.api_url,
        [url for _, url in replicas],
        sim.time_scale,
        interval=config.routing.agent_interval * sim.time_scale,
        route=BATCH if config.lanes.get(policy.key) else "chat",
    ) as sampler:
        run = asyncio.run(
            replay(
                workload,
                stack.url,
                model=MODEL,
                time_scale=sim.time_scale,
                replicas=replicas,
                deadline=config.deadline,
                # The samples' clock is the replay's, so they fall in the right phase.
                on_start=sampler.align,
                stop_at=config.duration,
            )
        )
    summary = replace(
        summarize(run.results, config),
        engines=engine_phases(sampler.samples, config),
        timed_out=run.timed_out,
        wall_seconds=run.wall_seconds,
        admission=sampler.samples,
        signals=lead_table(sampler.samples, run.results),
        replica_metrics=replica_metrics(stack),
    )
    for name, row in summary.engines.items():
        print(
            f"   {name}: running {num(row['running'], '{:.1f}')}, waiting "
            f"{num(row['waiting'], '{:.2f}')} per replica, KV {num(row['kv_cache'], '{:.2f}')}, "
            f"saturated {num(row['saturated_share'], '{:.0%}')} of samples",
            flush=True,
        )
    for name, class_row in summary.classes.items():
        print(
            f"   {name}: {class_row.ok}/{class_row.requests} ok, shed {class_row.shed}, "
            f"TTFT p50 {num(class_row.ttft_p50)} p99 {num(class_row.ttft_p99)}, "
            f"goodput {num(class_row.goodput_per_s, '{:.2f}')}/s",
            flush=True,
        )
    print(
        f"   goodput {summary.goodput_per_s:.2f}/s, recovered "
        f"{num(summary.recovery_s, '{:.1f}')}s after the overload ({run.wall_seconds:.0f}s wall)",
        flush=True,
    )
    return summary


def _workloads(config: ClassesConfig) -> tuple[Workload, Workload, ClassesCalibration]:
    """`build_workloads`, kept in the output folder between runs of the same settings:
    on a busy 2-core machine, generating and calibrating them took from two to eight
    minutes, as long as the replays."""
    key = hashlib.sha256(
        repr((config.replicas, config.phases, config.routing)).encode()
    ).hexdigest()[:16]
    cache = Path(config.out_dir) / ".cache" / f"classes-workloads-{key}.pickle"
    if cache.exists():
        with contextlib.suppress(Exception), cache.open("rb") as file:
            built: tuple[Workload, Workload, ClassesCalibration] = pickle.load(file)
            # A cache written before the calibration was typed is built again.
            if isinstance(built[2], ClassesCalibration):
                return built
    built = build_workloads(config)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with cache.open("wb") as file:
        pickle.dump(built, file)
    return built


def _start_stack(
    exits: contextlib.ExitStack, state_dir: Path, routing: RoutingConfig, tries: int = 3
) -> Stack:
    """`start_stack`, tried again when a process is not ready in time: at load averages of
    30 on 2 cores, kvpilot once took longer than its launcher waits."""
    for attempt in range(1, tries + 1):
        try:
            return exits.enter_context(start_stack(state_dir / f"try{attempt}", routing))
        except LauncherError as error:
            if attempt == tries:
                raise
            print(f"   the stack did not start ({error}); trying again", flush=True)
    raise AssertionError("unreachable")


def run_classes(config: ClassesConfig, state_dir: Path | None = None) -> Path:
    """Run the benchmark; returns the Markdown report's path."""
    started = time.monotonic()
    alone, mixed, calibration = _workloads(config)
    print(
        f"workload: {alone.requests} interactive requests, "
        f"{mixed.requests - alone.requests} batch requests "
        f"({time.monotonic() - started:.0f}s to build)",
        flush=True,
    )
    routing = replace(config.routing, replicas=config.replicas)
    results: dict[str, PolicyRun] = {}
    with contextlib.ExitStack() as exits:
        if state_dir is None:
            state_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvclass-")))
        print("starting etcd, kvpilot, simulated replicas, Envoy and a telemetry agent ...")
        stack = _start_stack(exits, state_dir, routing)
        put_pool(stack)
        results[REFERENCE.key] = run_one(stack, REFERENCE, alone, config)
        for policy in POLICIES:
            if policy.key in config.policies or (not config.policies and policy.default):
                results[policy.key] = run_one(stack, policy, mixed, config)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = out / f"classes-{stamp}.md"
    report.write_text(markdown(results, config, calibration))
    payload = {
        "config": {
            "replicas": config.replicas,
            "phases": [asdict(p) for p in config.phases],
            "objectives": config.objectives,
            "service_classes": config.service_classes,
            "sim": asdict(config.routing.sim),
        },
        "calibration": calibration.to_json(),
        "targets": [{"what": w, "met": m, "measured": s} for w, m, s in targets(results)],
        "wall_seconds": time.monotonic() - started,
        "results": {key: run.to_json() for key, run in results.items()},
    }
    report.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str))
    print(report.read_text())
    print(f"{time.monotonic() - started:.0f}s in all")
    return report
