"""The service-class benchmark: interactive chat keeps its latency while batch overloads the
fleet, through a real Envoy configured by kvpilot.

Same stack as the routing benchmark (embedded etcd, ``kvpilot serve``, simulated vLLM
replicas, a real Envoy, ``kvpilot agent`` writing telemetry), with 8 replicas. Each policy
replays the same requests in three phases (simulated seconds):

1. calm: interactive multi-turn chat at 40% of capacity plus batch at 10% (50% in all);
2. overload: interactive at 60% plus batch pushing the total to 130%;
3. calm again at 50%.

Capacity is the routing benchmark's cache-blind estimate. Batch requests are single long
prompts without a session id, sent with ``x-priority: batch`` and one of a few tenants;
shed requests are not retried. Policies: round robin, session affinity alone, and session
affinity with service classes (batch is shed while the pool is saturated). A fourth run,
the reference, replays the interactive requests alone under affinity.

Reported per class and policy: TTFT p50/p99, goodput (requests that met their class's TTFT
objective, per second), shed and diverted counts, errors, and the time to recover (from the
end of the overload to the last request that missed its objective or was shed); and the
issue's targets as met / not met rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen import RequestResult, replay
from bench.report import _num
from bench.routing import (
    AFFINITY,
    MODEL,
    POLICY_NAME,
    BenchConfig,
    Policy,
    Stack,
    _idle,
    _policy_body,
    _policy_live,
    _pool_body,
    _probe,
    _replica_metrics,
    _warm,
    calibrate,
    percentile,
    start_stack,
)
from bench.routing import default_config as routing_config
from bench.workload import Session, Workload, WorkloadConfig
from controlplane.launchers import wait_until

INTERACTIVE, BATCH = "interactive", "batch"
TENANTS = ("evals", "nightly-etl", "backfill")


@dataclass(frozen=True)
class Phase:
    """A stretch of the run: its length (simulated seconds) and offered loads, as shares of
    the fleet's cache-blind capacity."""

    name: str
    duration: float
    interactive: float
    batch: float


@dataclass(frozen=True)
class ClassesConfig:
    """One run of the service-class benchmark."""

    replicas: int = 8
    phases: tuple[Phase, ...] = (
        Phase("calm", 10.0, 0.4, 0.1),
        Phase("overload", 40.0, 0.6, 0.7),
        Phase("recovery", 30.0, 0.4, 0.1),
    )
    objectives: dict[str, float] = field(default_factory=lambda: {INTERACTIVE: 1.0, BATCH: 30.0})
    """TTFT objective of each class, simulated seconds: goodput counts requests within it."""
    service_classes: dict[str, Any] = field(default_factory=dict)
    """The policy's serviceClasses (see `default_config`)."""
    deadline: float = 540.0
    out_dir: Path = Path("bench/results")
    routing: BenchConfig = field(default_factory=lambda: routing_config())
    """The routing benchmark's simulator, chat workload and agent settings, reused."""


POLICIES: tuple[Policy, ...] = (
    Policy("round_robin", "round robin", {"balancing": "round_robin"}),
    Policy(
        "affinity", "affinity alone", {"balancing": "least_request", "sessionAffinity": AFFINITY}
    ),
    Policy(
        "classes",
        "affinity + service classes",
        {"balancing": "least_request", "sessionAffinity": AFFINITY},
    ),
)
REFERENCE = Policy(
    "reference",
    "affinity, interactive alone (no batch)",
    {"balancing": "least_request", "sessionAffinity": AFFINITY},
)


def default_config(short: bool = False) -> ClassesConfig:
    """The `make bench BENCH_ARGS=classes` settings, or a smoke run with `short`."""
    base = routing_config()
    # 8 replicas at 130% load, hundreds of streams at once, are far more work for one
    # simulator and one load generator than the routing benchmark's 4 replicas at 75%: here
    # simulated time runs 3x slower than the wall clock and streams send a chunk a second
    # after the first token, so that a busy 2-core machine keeps up (at the routing
    # benchmark's pace, connections to Envoy timed out and no replica queue ever formed:
    # the load generator, not the replicas, was the bottleneck). The agent scrapes every
    # 0.75 s of wall time.
    base = replace(
        base,
        sim=replace(base.sim, time_scale=3.0, stream_interval=1.0),
        agent_interval=0.25,
    )
    # Intervals are wall-clock seconds: a shedding step every second, a step given back
    # after 3 s below the low mark.
    service_classes = {
        "tenantHeader": "x-tenant-id",
        "saturation": {
            "queue": 2,
            "high": 1.0,
            "low": 0.25,
            "step": 25,
            "shedInterval": "1s",
            "recoverInterval": "3s",
        },
        "classes": [
            {"name": INTERACTIVE, "objective": {"ttft": "1s"}},
            {
                "name": BATCH,
                "match": {"headers": [{"name": "x-priority", "value": "batch"}]},
                "objective": {"ttft": "30s"},
                "whenSaturated": "shed",
                "retryAfter": "30s",
            },
        ],
    }
    config = ClassesConfig(service_classes=service_classes, routing=base)
    if short:
        config = replace(
            config,
            replicas=4,
            phases=(
                Phase("calm", 4.0, 0.4, 0.1),
                Phase("overload", 8.0, 0.6, 0.7),
                Phase("recovery", 6.0, 0.4, 0.1),
            ),
            deadline=60.0,
            routing=replace(
                base,
                workload=replace(
                    base.workload, max_turns=3, think_mean=1.0, answer_median=60, length_cap=200
                ),
            ),
        )
    return config


# --------------------------------------------------------------------------- workloads


def _shifted(sessions: tuple[Session, ...], offset: float, **changes: Any) -> list[Session]:
    return [replace(s, start=s.start + offset, **changes) for s in sessions]


def build_workloads(config: ClassesConfig) -> tuple[Workload, Workload, dict[str, Any]]:
    """The interactive requests alone and interactive plus batch, phase by phase, each phase
    calibrated to its share of capacity (the routing benchmark's search)."""
    routing = replace(config.routing, replicas=config.replicas)
    chat_base = routing.workload
    batch_base = WorkloadConfig(
        kind="docs",
        # Many distinct long documents: batch jobs over a corpus share little prefix, and
        # long requests keep the request count (the load generator's work) down.
        documents=tuple(2000 + 50 * (i % 20) for i in range(120)),
        question_median=60,
        answer_median=300,
        length_cap=600,
    )
    interactive: list[Session] = []
    batch: list[Session] = []
    calibration: dict[str, Any] = {}
    offset = 0.0
    for index, phase in enumerate(config.phases):
        chat, chat_cal = calibrate(
            replace(routing, target_load=phase.interactive),
            replace(chat_base, duration=phase.duration, seed=chat_base.seed + index),
        )
        docs, docs_cal = calibrate(
            replace(routing, target_load=phase.batch, warm_system_prompts=False),
            replace(batch_base, duration=phase.duration, seed=101 + index),
        )
        interactive += _shifted(chat.sessions, offset)
        batch += [
            replace(
                session,
                start=session.start + offset,
                extra_headers=(("x-priority", "batch"), ("x-tenant-id", TENANTS[n % 3])),
            )
            for n, session in enumerate(docs.sessions)
        ]
        calibration[phase.name] = {"interactive": chat_cal, "batch": docs_cal}
        offset += phase.duration
    alone = Workload(chat_base, tuple(sorted(interactive, key=lambda s: s.start)))
    mixed = Workload(chat_base, tuple(sorted(interactive + batch, key=lambda s: s.start)))
    return alone, mixed, calibration


def class_of(result: RequestResult) -> str:
    """Chat sessions are interactive; the document requests are the batch."""
    return BATCH if result.session.startswith("d") else INTERACTIVE


# --------------------------------------------------------------------------- the runs


def _apply(stack: Stack, policy: Policy, config: ClassesConfig) -> None:
    body = _policy_body(stack, policy)
    if policy.key == "classes":
        body["spec"]["serviceClasses"] = config.service_classes
    stack.put(body)
    classified = policy.key == "classes"
    wait_until(lambda: _policy_live(stack, policy), 60, f"Envoy to serve {policy.key}")
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


class AdmissionSampler:
    """Reads kvpilot's admission gauges while a run lasts: when batch was restricted."""

    def __init__(self, api_url: str, time_scale: float) -> None:
        self.api_url = api_url
        self.time_scale = time_scale
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> AdmissionSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        route = f"{POLICY_NAME}/chat"
        while not self._stop.wait(0.25):
            with contextlib.suppress(httpx.HTTPError):
                text = httpx.get(f"{self.api_url}/metrics", timeout=2).text
                sample = {"at": (time.monotonic() - self._started) / self.time_scale}
                for line in text.splitlines():
                    if f'route="{route}"' not in line or line.startswith("#"):
                        continue
                    name, _, value = line.rpartition(" ")
                    if name.startswith("kvpilot_admission_pressure"):
                        sample["pressure"] = float(value)
                    elif f'service_class="{BATCH}"' in name and "admitted_ratio" in name:
                        sample["batch_admitted"] = float(value)
                self.samples.append(sample)


def run_one(
    stack: Stack, policy: Policy, workload: Workload, config: ClassesConfig
) -> dict[str, Any]:
    sim = config.routing.sim
    print(f"\n== {policy.title}: {workload.requests} requests", flush=True)
    _apply(stack, policy, config)
    wait_until(lambda: _probe(stack), 30, "a request through Envoy")
    wait_until(lambda: _idle(stack), 120, "the replicas to go idle")
    stack.backends.reset()
    prompts = workload.system_prompts()
    asyncio.run(_warm(stack, prompts))
    wait_until(lambda: _idle(stack), 60, "the replicas to go idle after warming")
    stack.backends.reset(keep_cache=True)
    with AdmissionSampler(stack.kvpilot.api_url, sim.time_scale) as sampler:
        run = asyncio.run(
            replay(
                workload,
                stack.url,
                model=MODEL,
                time_scale=sim.time_scale,
                replicas=[(r.id, r.url) for r in stack.backends.replicas],
                deadline=config.deadline,
            )
        )
    summary = summarize(run.results, config)
    summary["timed_out"] = run.timed_out
    summary["wall_seconds"] = run.wall_seconds
    summary["admission"] = sampler.samples
    summary["replica_metrics"] = _replica_metrics(stack)
    for name, row in summary["classes"].items():
        print(
            f"   {name}: {row['ok']}/{row['requests']} ok, shed {row['shed']}, "
            f"TTFT p50 {_num(row['ttft_p50'])} p99 {_num(row['ttft_p99'])}, "
            f"goodput {_num(row['goodput_per_s'], '{:.2f}')}/s",
            flush=True,
        )
    print(
        f"   goodput {summary['goodput_per_s']:.2f}/s, recovered "
        f"{_num(summary['recovery_s'], '{:.1f}')}s after the overload ({run.wall_seconds:.0f}s wall)",
        flush=True,
    )
    return summary


def summarize(results: list[RequestResult], config: ClassesConfig) -> dict[str, Any]:
    """Per class and overall: TTFT, goodput, shed, errors; and the time to recover."""
    total = sum(phase.duration for phase in config.phases)
    overload_end = sum(phase.duration for phase in config.phases[:2])
    classes: dict[str, Any] = {}
    misses: list[float] = []
    good_total = 0
    for name in (INTERACTIVE, BATCH):
        mine = [r for r in results if class_of(r) == name]
        ok = [r for r in mine if r.ok]
        shed = [r for r in mine if r.status == 429]
        errors = [r for r in mine if not r.ok and r.status != 429]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        good = [r for r in ok if r.ttft is not None and r.ttft <= config.objectives[name]]
        good_total += len(good)
        misses += [r.start for r in mine if r not in good]
        classes[name] = {
            "requests": len(mine),
            "ok": len(ok),
            "shed": len(shed),
            "diverted": 0,
            "errors": len(errors),
            "error_kinds": sorted({r.error for r in errors})[:5],
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99),
            "met_objective": len(good),
            "goodput_per_s": len(good) / total,
        }
    late = [start for start in misses if start >= overload_end]
    return {
        "classes": classes,
        "goodput_per_s": good_total / total,
        "recovery_s": (max(late) - overload_end) if late else 0.0,
        "shed_in_calm_phase": sum(
            1 for r in results if r.status == 429 and r.start < config.phases[0].duration
        ),
        "per_request": [{**r.to_json(), "class": class_of(r)} for r in results],
    }


# --------------------------------------------------------------------------- report


def targets(results: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """The issue's targets, side by side from one run: (what, met?, measured)."""
    ref = results.get("reference", {}).get("classes", {}).get(INTERACTIVE, {}).get("ttft_p99")
    rows: list[tuple[str, bool | None, str]] = []

    def p99(key: str) -> float | None:
        value: float | None = (
            results.get(key, {}).get("classes", {}).get(INTERACTIVE, {}).get("ttft_p99")
        )
        return value

    def ratio(key: str) -> float | None:
        value = p99(key)
        return value / ref if value is not None and ref else None

    classes, alone = ratio("classes"), ratio("affinity")
    rows.append(
        (
            "interactive TTFT p99 with service classes within 1.5x of no batch at all",
            None if classes is None else classes <= 1.5,
            f"{_num(classes, '{:.2f}')}x ({_num(p99('classes'))}s vs {_num(ref)}s)",
        )
    )
    rows.append(
        (
            "affinity alone lets it grow past 5x",
            None if alone is None else alone > 5,
            f"{_num(alone, '{:.2f}')}x ({_num(p99('affinity'))}s)",
        )
    )
    goodput = results.get("classes", {}).get("goodput_per_s")
    goodput_alone = results.get("affinity", {}).get("goodput_per_s")
    rows.append(
        (
            "total goodput with classes at least affinity alone's",
            None if goodput is None or goodput_alone is None else goodput >= goodput_alone,
            f"{_num(goodput, '{:.2f}')}/s vs {_num(goodput_alone, '{:.2f}')}/s",
        )
    )
    batch = results.get("classes", {}).get("classes", {}).get(BATCH)
    rows.append(
        (
            "batch work that is admitted completes",
            None if batch is None else batch["errors"] == 0,
            "n/a"
            if batch is None
            else f"{batch['ok']} of {batch['requests'] - batch['shed']} admitted completed, "
            f"{batch['errors']} errors",
        )
    )
    calm = results.get("classes", {}).get("shed_in_calm_phase")
    rows.append(
        (
            "nothing is shed when the fleet has room (the calm first phase)",
            None if calm is None else calm == 0,
            f"{calm} shed",
        )
    )
    return rows


def markdown(results: dict[str, Any], config: ClassesConfig, calibration: dict[str, Any]) -> str:
    titles = {p.key: p.title for p in (REFERENCE, *POLICIES)}
    phases = ", ".join(
        f"{p.name} {p.duration:g}s (interactive {p.interactive:.0%} + batch {p.batch:.0%})"
        for p in config.phases
    )
    lines = [
        "# Service classes under overload",
        "",
        f"{config.replicas} simulated replicas behind one real Envoy configured by kvpilot. "
        f"Phases (simulated seconds): {phases}. TTFT objectives: interactive "
        f"{config.objectives[INTERACTIVE]:g}s, batch {config.objectives[BATCH]:g}s. Times in "
        "simulated seconds.",
        "",
        "| policy | class | requests | ok | shed | diverted | errors | TTFT p50 | TTFT p99 "
        "| goodput/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, summary in results.items():
        for name, row in summary["classes"].items():
            if not row["requests"]:
                continue
            lines.append(
                f"| {titles[key]} | {name} | {row['requests']} | {row['ok']} | {row['shed']} "
                f"| {row['diverted']} | {row['errors']} | {_num(row['ttft_p50'])} "
                f"| {_num(row['ttft_p99'])} | {row['goodput_per_s']:.2f} |"
            )
    lines += [
        "",
        "| policy | total goodput/s | time to recover (s) |",
        "|---|---:|---:|",
    ]
    for key, summary in results.items():
        lines.append(
            f"| {titles[key]} | {summary['goodput_per_s']:.2f} | {summary['recovery_s']:.1f} |"
        )
    lines += ["", "## Targets", "", "| target | met | measured |", "|---|---|---|"]
    for what, met, measured in targets(results):
        verdict = "n/a" if met is None else ("met" if met else "not met")
        lines.append(f"| {what} | {verdict} | {measured} |")
    lines += [
        "",
        "Time to recover: from the end of the overload to the start of the last request that "
        "was shed or missed its class's objective.",
        "",
        "Calibration (rates found for each phase's share of cache-blind capacity):",
        "",
        "```json",
        json.dumps(calibration, indent=1),
        "```",
        "",
    ]
    return "\n".join(lines)


def run_classes(config: ClassesConfig, state_dir: Path | None = None) -> Path:
    """Run the benchmark; returns the Markdown report's path."""
    alone, mixed, calibration = build_workloads(config)
    print(
        f"workload: {alone.requests} interactive requests, "
        f"{mixed.requests - alone.requests} batch requests",
        flush=True,
    )
    routing = replace(config.routing, replicas=config.replicas)
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as exits:
        if state_dir is None:
            state_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvclass-")))
        print("starting etcd, kvpilot, simulated replicas, Envoy and a telemetry agent ...")
        stack = exits.enter_context(start_stack(state_dir, routing))
        stack.put(_pool_body(stack))
        stack.put(
            {
                "apiVersion": "kvpilot.io/v1",
                "kind": "Fleet",
                "metadata": {"name": "default"},
                "spec": {"accessLog": False},
            }
        )
        results[REFERENCE.key] = run_one(stack, REFERENCE, alone, config)
        for policy in POLICIES:
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
        "calibration": calibration,
        "targets": [{"what": w, "met": m, "measured": s} for w, m, s in targets(results)],
        "results": results,
    }
    report.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str))
    print(report.read_text())
    return report
