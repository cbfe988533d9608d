"""The routing benchmark: the same workloads, several kvpilot policies, one real Envoy, one run.

It starts an embedded etcd, ``kvpilot serve``, a cluster of simulated vLLM replicas (one
process), a real Envoy fed by kvpilot over ADS and one ``kvpilot agent`` that writes every
replica's telemetry to etcd. For each policy it applies a RoutingPolicy through the REST API,
waits until Envoy's ``/config_dump`` shows it, resets the replicas' prefix caches and
counters, puts the shared system prompts back in every cache (a fleet in service holds them),
replays the policy's workload through Envoy, and reads the replicas' ``/metrics``.

Two workloads: multi-turn chat with session ids (the issue's targets are measured on it), and
shared long documents without session ids (for prompt-prefix affinity). It writes a Markdown
report, a JSON file, every request's measurements and (with matplotlib) PNG plots.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.rig.loadgen import replay
from bench.rig.routes import PREFIX_HASH_CHARS, Policy, bounded_load, standard_policies
from bench.rig.stack import (
    MODEL,
    POLICY_NAME,
    POOL,
    Stack,
    apply_policy,
    put_pool,
    ready_for_replay,
    replica_metrics,
    say,
    start_stack,
    telemetry_fresh,
    telemetry_metrics,
)
from bench.rig.summary import summarize
from bench.rig.workload import (
    CHAT,
    Workload,
    WorkloadConfig,
    cache_blind_cost,
    generate,
    oracle_hit_rate,
)
from bench.routing.results import Calibration
from bench.routing.sequential_report import (
    PolicyResult,
    TelemetryMoves,
    WorkloadGroup,
    write_report,
)
from controlplane.local import wait_until
from replicasim.simulator import SimConfig

_STANDARD = standard_policies()
POLICIES: tuple[Policy, ...] = (
    *_STANDARD.values(),
    # Sensitivity of the bounded-load factor: tighter spills more sessions onto cold
    # replicas, looser lets hot replicas queue.
    bounded_load(
        _STANDARD["affinity"], 125, "affinity_125", "sensitivity: affinity + bounded load 125"
    ),
    bounded_load(
        _STANDARD["affinity"], 200, "affinity_200", "sensitivity: affinity + bounded load 200"
    ),
    # The shared-document workload: no session ids, every request is a long document plus a
    # question. Prompt-prefix affinity hashes the prompt's head inside Envoy instead.
    Policy("docs_round_robin", "documents: round robin", {"balancing": "round_robin"}, "docs"),
    Policy(
        "docs_prefix",
        "documents: kvpilot prompt-prefix affinity",
        {
            "balancing": "least_request",
            "sessionAffinity": {"hashBalanceFactor": 150, "prefixHashChars": PREFIX_HASH_CHARS},
        },
        "docs",
    ),
)


@dataclass(frozen=True)
class RoutingConfig:
    """One benchmark run."""

    replicas: int = 4
    sim: SimConfig = field(default_factory=SimConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """The multi-turn chat workload (the issue's targets are measured on it)."""
    docs_workload: WorkloadConfig = field(
        default_factory=lambda: WorkloadConfig(kind="docs", duration=30.0)
    )
    """The shared-document workload, for the prompt-prefix affinity rows."""
    target_load: float = 0.75
    """Offered load as a share of the cluster's cache-blind capacity (estimated)."""
    deadline: float = 240.0
    """Wall-clock limit of one policy's replay."""
    policies: tuple[str, ...] = tuple(p.key for p in POLICIES if p.default)
    """The policies to run; the bounded-load sensitivity rows only when asked for
    (``--policies``), so that `make bench` stays within 10 minutes."""
    warm_system_prompts: bool = True
    """Put the chat workload's shared system prompts in every replica's cache before each
    replay (see `bench.rig.stack.ready_for_replay`), so runs measure a fleet in service rather than a cold start."""
    agent_interval: float = 1.0
    """Simulated seconds between the telemetry agent's scrapes."""
    out_dir: Path = Path("bench/results")
    plots: bool = True
    capacity_batch: int | None = None
    """Batch at which capacity is estimated (`cache_blind_cost`); None: half the max batch."""


def default_config(short: bool = False) -> RoutingConfig:
    """The `make bench` settings, or the smoke-test ones with `short`."""
    sim = SimConfig(
        max_batch=32,
        max_batched_tokens=2048,
        kv_blocks=3072,
        prefill_per_token=1 / 4000,
        decode_base=0.02,
        decode_per_seq=0.0004,
        # Simulated time runs 2.5x faster than the wall clock so that every policy fits
        # `make bench`'s 10 minutes; engine steps stay 8 ms or longer in wall time.
        time_scale=0.4,
        stream_interval=0.2,
        orca=True,
    )
    workload = CHAT
    docs = WorkloadConfig(
        kind="docs",
        duration=30.0,
        documents=(2000, 3000, 4000, 5000, 6000, 8000),
        question_median=100,
        answer_median=150,
    )
    if short:
        workload = replace(
            workload, duration=6.0, max_turns=3, think_mean=1.0, answer_median=60, length_cap=200
        )
        docs = replace(docs, duration=3.0, answer_median=60, length_cap=200)
        return RoutingConfig(
            sim=sim,
            workload=workload,
            docs_workload=docs,
            deadline=30.0,
            plots=False,
            policies=("round_robin", "affinity", "affinity_telemetry", "orca", "docs_prefix"),
        )
    return RoutingConfig(sim=sim, workload=workload, docs_workload=docs)


def calibrate(config: RoutingConfig, base: WorkloadConfig) -> tuple[Workload, Calibration]:
    """`base` at the arrival rate that offers `target_load` of cache-blind capacity.

    The rate is the session rate of a chat workload, the document request rate of a
    document workload; a mix scales both and keeps their ratio. The load grows with the rate in steps (each new session adds its
    cost), so the rate is searched for rather than set in one step.
    """
    replicas, duration = config.replicas, base.duration

    def at(rate: float) -> tuple[Workload, float]:
        if base.kind == "docs":
            workload = generate(replace(base, doc_rate=rate))
        elif base.kind == "mix":
            ratio = base.doc_rate / base.session_rate
            workload = generate(replace(base, session_rate=rate, doc_rate=rate * ratio))
        else:
            workload = generate(replace(base, session_rate=rate))
        warm = workload.system_prompts() if config.warm_system_prompts else []
        cost = cache_blind_cost(workload, config.sim, replicas, warm, config.capacity_batch)
        return workload, cost / (replicas * duration)

    target = config.target_load
    rate = 1.0
    workload, load = at(rate)
    best = (abs(load - target), rate, load, workload)
    low, high = 0.0, float("inf")
    for _ in range(14):
        if not load or best[0] < 0.01:
            break
        if load < target:
            low = max(low, rate)
        else:
            high = min(high, rate)
        # Proportional steps until the target is bracketed, then bisection: the load grows
        # with the rate, but in steps (one more long session), so it may never be hit exactly.
        rate = rate * target / load if high == float("inf") or low == 0.0 else (low + high) / 2
        workload, load = at(rate)
        best = min(best, (abs(load - target), rate, load, workload), key=lambda b: b[0])
    _, rate, load, workload = best
    if base.kind == "docs":
        return workload, Calibration(doc_rate=rate, estimated_cache_blind_load=load)
    return workload, Calibration(session_rate=rate, estimated_cache_blind_load=load)


# --------------------------------------------------------------------------- the run


def run_policy(
    stack: Stack, policy: Policy, workload: Workload, config: RoutingConfig
) -> PolicyResult:
    say(f"\n== {policy.title}: apply RoutingPolicy/{POLICY_NAME} {json.dumps(policy.route)}")
    apply_policy(stack, policy.key, policy.route)
    telemetry = policy.route.get("balancing") == "telemetry"
    if telemetry:
        wait_until(lambda: telemetry_fresh(stack), 30, "kvpilot to weigh the replicas by telemetry")
    before = telemetry_metrics(stack)
    system_prompts = workload.system_prompts() if config.warm_system_prompts else []
    ready_for_replay(stack, system_prompts)
    say(
        "   Envoy serves it; replica caches reset"
        + (f" and warmed with {len(system_prompts)} system prompts" if system_prompts else "")
        + f"; replaying {workload.requests} requests ..."
    )
    run = asyncio.run(
        replay(
            workload,
            stack.url,
            model=MODEL,
            time_scale=config.sim.time_scale,
            replicas=[(r.id, r.url) for r in stack.backends.replicas],
            deadline=config.deadline,
        )
    )
    summary = summarize(run, replica_metrics(stack))
    moves = None
    if telemetry:
        after = telemetry_metrics(stack)
        changes = f'kvpilot_telemetry_weight_changes_total{{pool="{POOL}"}}'
        pushes = 'kvpilot_snapshot_pushes_total{cause="telemetry"}'
        moves = TelemetryMoves(
            weight_changes=after.get(changes, 0.0) - before.get(changes, 0.0),
            telemetry_pushes=after.get(pushes, 0.0) - before.get(pushes, 0.0),
            weights_at_end={
                k.split('endpoint="', 1)[1].split('"', 1)[0]: v
                for k, v in after.items()
                if k.startswith("kvpilot_telemetry_weight{")
            },
        )
        say(f"   telemetry: {asdict(moves)}")
    say(
        f"   {summary.ok}/{summary.requests} ok, hit rate {_fmt(summary.hit_rate, '%')}, "
        f"TTFT p50 {_fmt(summary.ttft_p50, 's')} p99 {_fmt(summary.ttft_p99, 's')}, "
        f"{_fmt(summary.throughput_tokens_per_s)} tok/s, "
        f"load max/mean {_fmt(summary.load_max_over_mean)}, "
        f"busy {_fmt(summary.busy_fraction_mean, '%')} ({run.wall_seconds:.0f}s wall)"
    )
    return PolicyResult(summary, moves)


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if unit == "%":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value:.3f}s" if value < 10 else f"{value:.1f}s"
    return f"{value:.2f}"


@dataclass
class WorkloadRun:
    """One workload of the benchmark and the policies replayed on it."""

    name: str
    workload: Workload
    calibration: Calibration
    oracle: float
    results: dict[str, PolicyResult] = field(default_factory=dict)


def run_routing(config: RoutingConfig, state_dir: Path | None = None) -> Path:
    """Run the benchmark; returns the Markdown report's path."""
    bases = {"chat": config.workload, "docs": config.docs_workload}
    wanted = [p for p in POLICIES if p.key in config.policies]
    runs: dict[str, WorkloadRun] = {}
    for name in dict.fromkeys(p.workload for p in wanted):
        workload, calibration = calibrate(config, bases[name])
        warm = workload.system_prompts() if config.warm_system_prompts else []
        oracle = oracle_hit_rate(workload, config.sim.block_size, warm)
        runs[name] = WorkloadRun(name, workload, calibration, oracle)
        summary = workload.summary()
        say(
            f"workload {name}: {summary.requests} requests in {summary.sessions} sessions "
            f"(+{summary.document_requests} document requests), rate {calibration.rate:.2f}/s, "
            f"estimated cache-blind load {calibration.estimated_cache_blind_load:.0%}, "
            f"oracle hit rate {oracle:.1%}"
        )
    with contextlib.ExitStack() as exits:
        if state_dir is None:
            state_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-")))
        say("starting etcd, kvpilot, simulated replicas, Envoy and a telemetry agent ...")
        stack = exits.enter_context(start_stack(state_dir, config))
        put_pool(stack)
        for policy in wanted:
            run = runs[policy.workload]
            run.results[policy.key] = run_policy(stack, policy, run.workload, config)
    return write_report(
        out_dir=Path(config.out_dir),
        plots=config.plots,
        groups=[
            WorkloadGroup(
                name=run.name,
                summary=run.workload.summary(),
                calibration=run.calibration,
                oracle=run.oracle,
                results=run.results,
            )
            for run in runs.values()
        ],
        titles={p.key: p.title for p in POLICIES},
        config_dict={
            "replicas": config.replicas,
            "sim": asdict(config.sim),
            "workload": asdict(config.workload),
            "docs_workload": asdict(config.docs_workload),
            "target_load": config.target_load,
            "agent_interval": config.agent_interval,
            "warm_system_prompts": config.warm_system_prompts,
            "prefix_hash_chars": PREFIX_HASH_CHARS,
        },
    )
