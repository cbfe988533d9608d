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
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from api.client import KvpilotClient
from bench.backend import BackendProcess
from bench.loadgen import RunResult, parse_metrics, replay
from bench.report import WorkloadGroup, write_report
from bench.simulator import SimConfig
from bench.workload import Workload, WorkloadConfig, cache_blind_cost, generate, oracle_hit_rate
from controlplane.launchers import (
    EmbeddedEnvoy,
    KvpilotProcess,
    ManagedProcess,
    free_port,
    local_stack,
    repo_root,
    wait_until,
)

MODEL = "sim-model"
POOL = "bench"
POLICY_NAME = "bench"
PREFIX_HASH_CHARS = 1024
"""Prompt characters hashed for prompt-prefix affinity: the system message and the first
couple of hundred words of the document, enough to tell the documents apart."""


@dataclass(frozen=True)
class Policy:
    """One routing policy under test: the route fields that differ from the others."""

    key: str
    title: str
    route: dict[str, Any]
    workload: str = "chat"
    """Which of the benchmark's workloads it replays: ``chat`` (multi-turn) or ``docs``."""
    default: bool = True
    """Run by `make bench`; the others only when named with ``--policies``."""


AFFINITY = {"header": "x-session-id", "hashBalanceFactor": 150}

POLICIES: tuple[Policy, ...] = (
    Policy("round_robin", "round robin", {"balancing": "round_robin"}),
    Policy("least_request", "least request", {"balancing": "least_request"}),
    Policy(
        "affinity",
        "kvpilot session affinity + bounded load",
        {"balancing": "least_request", "sessionAffinity": AFFINITY},
    ),
    # Session affinity plus weights from live telemetry: `kvpilot agent` scrapes the
    # replicas into etcd, kvpilot turns queue depth and KV use into endpoint weights, which
    # the ring-hash twin cluster (the one session requests use) honours too.
    Policy(
        "affinity_telemetry",
        "kvpilot affinity + telemetry weights",
        {"balancing": "telemetry", "sessionAffinity": AFFINITY},
    ),
    # ORCA cannot combine with session affinity (one cluster has one load balancer), so this
    # row is Envoy's client-side weighted round robin on the replicas' load reports alone.
    Policy("orca", "ORCA weighted round robin (no affinity)", {"balancing": "orca"}),
    # Sensitivity of the bounded-load factor (run with --policies): tighter spills more
    # sessions onto cold replicas, looser lets hot replicas queue.
    Policy(
        "affinity_125",
        "sensitivity: affinity + bounded load 125",
        {"balancing": "least_request", "sessionAffinity": {**AFFINITY, "hashBalanceFactor": 125}},
        default=False,
    ),
    Policy(
        "affinity_200",
        "sensitivity: affinity + bounded load 200",
        {"balancing": "least_request", "sessionAffinity": {**AFFINITY, "hashBalanceFactor": 200}},
        default=False,
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
class BenchConfig:
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
    replay (see `_warm`), so runs measure a fleet in service rather than a cold start."""
    agent_interval: float = 1.0
    """Simulated seconds between the telemetry agent's scrapes."""
    out_dir: Path = Path("bench/results")
    plots: bool = True
    capacity_batch: int | None = None
    """Batch at which capacity is estimated (`cache_blind_cost`); None: half the max batch."""


def default_config(short: bool = False) -> BenchConfig:
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
    # Multi-turn chat as people use it: a few long shared system prompts, five turns on
    # average (up to eight), each prompt the whole conversation so far, so histories grow to
    # thousands of tokens; heavy-tailed questions and answers.
    workload = WorkloadConfig(
        kind="multiturn",
        duration=80.0,
        system_prompts=(1000, 2000, 3000, 4000),
        question_median=100,
        answer_median=200,
        length_cap=600,
        mean_turns=5.0,
        max_turns=8,
        think_mean=3.0,
    )
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
        return BenchConfig(
            sim=sim,
            workload=workload,
            docs_workload=docs,
            deadline=30.0,
            plots=False,
            policies=("round_robin", "affinity", "affinity_telemetry", "orca", "docs_prefix"),
        )
    return BenchConfig(sim=sim, workload=workload, docs_workload=docs)


def calibrate(config: BenchConfig, base: WorkloadConfig) -> tuple[Workload, dict[str, Any]]:
    """`base` at the arrival rate that offers `target_load` of cache-blind capacity.

    The rate is the session rate of a chat workload, the document request rate of a
    document workload; a mix scales both and keeps their ratio. The load grows with the rate in steps (each new session adds its
    cost), so the rate is searched for rather than set in one step.
    """
    replicas, duration = config.replicas, base.duration
    rate_field = "doc_rate" if base.kind == "docs" else "session_rate"

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
    return workload, {rate_field: rate, "estimated_cache_blind_load": load}


# --------------------------------------------------------------------------- the stack


def _say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Stack:
    kvpilot: KvpilotProcess
    envoy: EmbeddedEnvoy
    backends: BackendProcess
    agent: ManagedProcess
    token: str
    listener_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}/v1/chat/completions"

    def put(self, body: dict[str, Any]) -> None:
        """Create or replace an object through the REST API."""
        KvpilotClient(self.kvpilot.api_url, token=self.token).put(body)


@contextlib.contextmanager
def start_stack(state_dir: Path, config: BenchConfig) -> Iterator[Stack]:
    with contextlib.ExitStack() as stack:
        # The benchmark measures routing, not disk: etcd skips fsync.
        local = stack.enter_context(
            local_stack(state_dir, node_id="bench-envoy", etcd_args=["--unsafe-no-fsync"])
        )
        backends = stack.enter_context(
            BackendProcess(
                config.replicas,
                id_prefix="replica",
                model=MODEL,
                state_dir=state_dir / "backends",
                simulator=config.sim,
            ).start()
        )
        agent = start_agent(
            state_dir / "agent",
            local.etcd.endpoint,
            [replica.url for replica in backends.replicas],
            pool=POOL,
            interval=config.agent_interval * config.sim.time_scale,
            max_running=config.sim.max_batch,
        )
        stack.callback(agent.stop)
        yield Stack(local.kvpilot, local.envoy, backends, agent, local.admin_token, free_port())


def start_agent(
    state_dir: Path,
    etcd_endpoint: str,
    urls: list[str],
    *,
    pool: str,
    interval: float,
    max_running: int,
) -> ManagedProcess:
    """One `kvpilot agent` for the replicas at `urls`, writing their telemetry to etcd every
    `interval` wall-clock seconds under `pool` (no registration: the pool lists its endpoints
    statically)."""
    argv = [
        sys.executable,
        "-m",
        "commands.cli",
        "agent",
        "--etcd-endpoints",
        etcd_endpoint,
        "--pool",
        pool,
        "--interval",
        f"{interval:g}",
        "--refresh",
        f"{3 * interval:g}",
        "--max-running",
        str(max_running),
        "--log-level",
        "warning",
    ]
    for url in urls:
        argv += ["--backend", url]
    agent = ManagedProcess(argv, state_dir / "agent.log", cwd=repo_root())
    agent.spawn()
    return agent


def _pool_body(stack: Stack) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Pool",
        "metadata": {"name": POOL},
        "spec": {
            "models": [MODEL],
            # Named, so the ring places replica i at the same points in every run.
            "endpoints": [
                {"address": r.host, "port": r.port, "name": f"replica-{index}"}
                for index, r in enumerate(stack.backends.replicas)
            ],
            "healthCheck": {"path": "/health", "interval": "1s", "timeout": "500ms"},
            # Read by routes with balancing 'telemetry' only; the others keep static weights.
            "telemetry": {"format": "vllm", "maxAge": "5s"},
        },
    }


def _policy_body(stack: Stack, policy: Policy) -> dict[str, Any]:
    route = {"name": "chat", "match": {"pathPrefix": "/v1/"}, "tiers": [[POOL]], **policy.route}
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "listener": {"address": "127.0.0.1", "port": stack.listener_port},
            "routes": [route],
        },
    }


def _lb_signature(cluster: dict[str, Any]) -> tuple[str, int]:
    """(load balancer, bounded-load factor) of a cluster from Envoy's /config_dump."""
    custom = cluster.get("load_balancing_policy", {}).get("policies", [])
    if custom:
        lb = custom[0].get("typed_extension_config", {}).get("name", "custom").rsplit(".", 1)[-1]
    else:
        lb = cluster.get("lb_policy", "ROUND_ROBIN")
    hashing = cluster.get("common_lb_config", {}).get("consistent_hashing_lb_config", {})
    return lb, int(hashing.get("hash_balance_factor", 0))


def _clusters_in_envoy(envoy: EmbeddedEnvoy) -> dict[str, tuple[str, int]]:
    """{cluster name: load-balancer signature} of Envoy's active dynamic clusters."""
    out: dict[str, tuple[str, int]] = {}
    for config in envoy.config_dump()["configs"]:
        for entry in config.get("dynamic_active_clusters", []):
            cluster = entry.get("cluster", {})
            out[cluster.get("name", "")] = _lb_signature(cluster)
    return out


def _expected_clusters(policy: Policy) -> dict[str, tuple[str, int]]:
    """The load-balancer signatures Envoy shows once `policy` is applied, by name suffix."""
    balancing = policy.route.get("balancing", "least_request")
    base = {
        "round_robin": "ROUND_ROBIN",
        "orca": "client_side_weighted_round_robin",
    }.get(balancing, "LEAST_REQUEST")
    out = {"": (base, 0)}
    affinity = policy.route.get("sessionAffinity")
    if affinity is not None:
        out["/affinity"] = ("RING_HASH", int(affinity.get("hashBalanceFactor", 150)))
    return out


def _policy_live(stack: Stack, policy: Policy) -> bool:
    try:
        clusters = _clusters_in_envoy(stack.envoy)
    except Exception:
        return False
    seen = {
        "/affinity" if name.endswith("/affinity") else "": signature
        for name, signature in clusters.items()
    }
    if len(clusters) != len(seen) or seen != _expected_clusters(policy):
        return False
    # Every replica healthy in every cluster, and the listener answering.
    hosts = [
        line
        for line in stack.envoy.clusters().splitlines()
        if "::health_flags::" in line and line.split("::", 1)[0] in clusters
    ]
    want_hosts = len(clusters) * len(stack.backends.replicas)
    return len(hosts) == want_hosts and all(line.endswith("::healthy") for line in hosts)


def _telemetry_metrics(stack: Stack) -> dict[str, float]:
    """kvpilot's telemetry counters and per-endpoint weights for the pool."""
    text = httpx.get(f"{stack.kvpilot.api_url}/metrics", timeout=5.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or (f'pool="{POOL}"' not in line and "cause=" not in line):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def _telemetry_fresh(stack: Stack) -> bool:
    """kvpilot has decided a weight from telemetry for every replica."""
    try:
        weights = [
            k for k in _telemetry_metrics(stack) if k.startswith("kvpilot_telemetry_weight{")
        ]
    except httpx.HTTPError:
        return False
    return len(weights) >= len(stack.backends.replicas)


def _probe(stack: Stack) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    with contextlib.suppress(httpx.HTTPError):
        return httpx.post(stack.url, json=body, timeout=10.0).status_code == 200
    return False


def _replica_metrics(stack: Stack) -> dict[str, dict[str, float]]:
    out = {}
    for replica in stack.backends.replicas:
        out[replica.id] = parse_metrics(httpx.get(f"{replica.url}/metrics", timeout=5.0).text)
    return out


async def _warm(stack: Stack, system_prompts: list[str]) -> None:
    """Send every shared system prompt to every replica once, straight (not through Envoy).

    A fleet that has been serving for a while holds its shared system prompts in every
    replica's cache (they are the most used blocks, and vLLM evicts a conversation from its
    end). Without this, the first minutes of every run pay for a cold start that no
    routing policy can avoid, and those few requests are the p99.
    """

    async def one(client: httpx.AsyncClient, url: str) -> None:
        for prompt in system_prompts:
            body = {
                "model": MODEL,
                "messages": [{"role": "system", "content": prompt}],
                "max_tokens": 1,
            }
            (await client.post(f"{url}/v1/chat/completions", json=body)).raise_for_status()

    async with httpx.AsyncClient(timeout=60.0) as client:
        await asyncio.gather(*(one(client, r.url) for r in stack.backends.replicas))


def _idle(stack: Stack) -> bool:
    return all(
        m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0
        for m in _replica_metrics(stack).values()
    )


# --------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(run: RunResult, metrics: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The numbers the report shows for one policy (times in simulated seconds)."""
    ok = [r for r in run.results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    latencies = [r.latency for r in ok if r.latency is not None]
    queries = sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in metrics.values())
    hits = sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in metrics.values())
    if run.results:
        first = min(r.start for r in run.results)
        last = max(r.start + (r.latency or 0.0) for r in run.results)
        makespan = max(1e-9, last - first)
    else:
        makespan = 0.0
    tokens = sum(r.completion_tokens for r in ok)
    served = Counter(r.replica for r in ok)
    replica_ids = sorted(metrics)
    mean_in_flight = {
        rid: statistics.fmean([s.in_flight.get(rid, 0.0) for s in run.samples] or [0.0])
        for rid in replica_ids
    }
    busy = {
        rid: m.get("kvpilot_sim_busy_seconds_total", 0.0)
        / max(1e-9, m.get("kvpilot_sim_elapsed_seconds", 0.0))
        for rid, m in metrics.items()
    }

    def max_over_mean(values: list[float]) -> float | None:
        mean = statistics.fmean(values) if values else 0.0
        return max(values) / mean if mean > 0 else None

    errors = Counter(r.error or f"HTTP {r.status}" for r in run.results if not r.ok)
    return {
        "requests": len(run.results),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors.most_common(5)),
        "answers_match": sum(1 for r in ok if r.answer_matches),
        "timed_out": run.timed_out,
        "hit_rate": hits / queries if queries else None,
        "client_hit_rate": (
            sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok))
        ),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99),
        "latency_p50": percentile(latencies, 50),
        "latency_p99": percentile(latencies, 99),
        "throughput_tokens_per_s": tokens / makespan if makespan else None,
        "requests_per_s": len(ok) / makespan if makespan else None,
        "makespan_s": makespan,
        "wall_seconds": run.wall_seconds,
        "served": {rid: served.get(rid, 0) for rid in replica_ids},
        "mean_in_flight": mean_in_flight,
        "load_max_over_mean": max_over_mean(list(mean_in_flight.values())),
        "served_max_over_mean": max_over_mean([float(served.get(r, 0)) for r in replica_ids]),
        "busy_fraction": busy,
        "busy_fraction_mean": statistics.fmean(busy.values()) if busy else None,
        "ttfts": ttfts,
        "per_request": [r.to_json() for r in run.results],
        "load_series": [
            {"at": s.at, **{rid: s.in_flight.get(rid, 0.0) for rid in replica_ids}}
            for s in run.samples
        ],
    }


# --------------------------------------------------------------------------- the run


def run_policy(
    stack: Stack, policy: Policy, workload: Workload, config: BenchConfig
) -> dict[str, Any]:
    _say(f"\n== {policy.title}: apply RoutingPolicy/{POLICY_NAME} {json.dumps(policy.route)}")
    stack.put(_policy_body(stack, policy))
    wait_until(lambda: _policy_live(stack, policy), 60, f"Envoy to serve {policy.key}")
    wait_until(lambda: _probe(stack), 30, "a request through Envoy")
    wait_until(lambda: _idle(stack), 60, "the replicas to go idle")
    telemetry = policy.route.get("balancing") == "telemetry"
    if telemetry:
        wait_until(
            lambda: _telemetry_fresh(stack), 30, "kvpilot to weigh the replicas by telemetry"
        )
    before = _telemetry_metrics(stack)
    stack.backends.reset()
    system_prompts = workload.system_prompts()
    if config.warm_system_prompts and system_prompts:
        asyncio.run(_warm(stack, system_prompts))
        wait_until(lambda: _idle(stack), 60, "the replicas to go idle after warming")
        stack.backends.reset(keep_cache=True)
    _say(
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
    summary = summarize(run, _replica_metrics(stack))
    if telemetry:
        after = _telemetry_metrics(stack)
        changes = f'kvpilot_telemetry_weight_changes_total{{pool="{POOL}"}}'
        pushes = 'kvpilot_snapshot_pushes_total{cause="telemetry"}'
        summary["telemetry"] = {
            "weight_changes": after.get(changes, 0.0) - before.get(changes, 0.0),
            "telemetry_pushes": after.get(pushes, 0.0) - before.get(pushes, 0.0),
            "weights_at_end": {
                k.split('endpoint="', 1)[1].split('"', 1)[0]: v
                for k, v in after.items()
                if k.startswith("kvpilot_telemetry_weight{")
            },
        }
        _say(f"   telemetry: {summary['telemetry']}")
    _say(
        f"   {summary['ok']}/{summary['requests']} ok, hit rate {_fmt(summary['hit_rate'], '%')}, "
        f"TTFT p50 {_fmt(summary['ttft_p50'], 's')} p99 {_fmt(summary['ttft_p99'], 's')}, "
        f"{_fmt(summary['throughput_tokens_per_s'])} tok/s, "
        f"load max/mean {_fmt(summary['load_max_over_mean'])}, "
        f"busy {_fmt(summary['busy_fraction_mean'], '%')} ({run.wall_seconds:.0f}s wall)"
    )
    return summary


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
    calibration: dict[str, Any]
    oracle: float
    results: dict[str, Any] = field(default_factory=dict)


def run_routing(config: BenchConfig, state_dir: Path | None = None) -> Path:
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
        rate = calibration.get("session_rate") or calibration.get("doc_rate") or 0.0
        _say(
            f"workload {name}: {summary['requests']} requests in {summary['sessions']} sessions "
            f"(+{summary['document_requests']} document requests), rate {rate:.2f}/s, "
            f"estimated cache-blind load {calibration['estimated_cache_blind_load']:.0%}, "
            f"oracle hit rate {oracle:.1%}"
        )
    with contextlib.ExitStack() as exits:
        if state_dir is None:
            state_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvbench-")))
        _say("starting etcd, kvpilot, simulated replicas, Envoy and a telemetry agent ...")
        stack = exits.enter_context(start_stack(state_dir, config))
        stack.put(_pool_body(stack))
        stack.put(
            {
                "apiVersion": "kvpilot.io/v1",
                "kind": "Fleet",
                "metadata": {"name": "default"},
                "spec": {"accessLog": False},
            }
        )
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
