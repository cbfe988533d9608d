"""The cost benchmark's run: one stack (etcd, kvpilot, Envoy, four owned replicas and their
telemetry agent) plus the paid API's simulated replica, each policy in turn on the same
requests (see `bench.cost.config`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from api.client import KvpilotClient
from bench.cost import spend
from bench.cost.config import (
    PAID_POOL,
    PAID_PREFIX,
    POLICIES,
    RESTART_POLICY,
    SINGLES,
    CostConfig,
)
from bench.cost.report import markdown, summarize
from bench.cost.results import (
    CostCalibration,
    CostSummary,
    OwnedHourly,
    PaidDollars,
    SpendCheck,
)
from bench.rig.loadgen import RequestResult, replay
from bench.rig.routes import Policy
from bench.rig.stack import (
    MODEL,
    POLICY_NAME,
    POOL,
    Stack,
    policy_body,
    put_pool,
    ready_for_replay,
    start_stack,
)
from bench.rig.workload import Session, Workload, generate
from bench.routing.sequential import calibrate
from controlplane.local import wait_until
from controlplane.local.replicas import BackendProcess


def build_workload(config: CostConfig) -> tuple[Workload, CostCalibration]:
    """Conversations and single requests, phase by phase, at the phases' loads.

    Each kind's rate is searched for once, at the owned capacity (load 1.0), and scaled by
    each phase's load. Capacity is taken with every request hitting all that was computed
    before it (one cache for the whole fleet: perfect affinity) at full batches: an upper
    bound on what the owned replicas serve, so 150% is more than they can, whatever bounded
    load spills and the KV cache evicts. (Taken cache-blind, as the routing benchmark does,
    the owned replicas served the short run's "150%" within their batches, with affinity.)
    """
    chat_base = replace(
        config.routing.workload, seed=config.routing.workload.seed + 100 * config.seed
    )
    singles_base = replace(SINGLES, seed=SINGLES.seed + 100 * config.seed)
    span = 30.0
    # One replica with the whole fleet's capacity: the load is cost / (1 x duration).
    fleet = replace(config.routing, replicas=1)
    _, chat_cal = calibrate(
        replace(fleet, target_load=config.conversation_share * config.replicas),
        replace(chat_base, duration=span),
    )
    _, singles_cal = calibrate(
        replace(
            fleet,
            target_load=(1.0 - config.conversation_share) * config.replicas,
            warm_system_prompts=False,
        ),
        replace(singles_base, duration=span),
    )
    sessions: list[Session] = []
    offset = 0.0
    for index, phase in enumerate(config.phases):
        chat = generate(
            replace(
                chat_base,
                duration=phase.duration,
                seed=chat_base.seed + index,
                session_rate=chat_cal.rate * phase.load,
            )
        )
        singles = generate(
            replace(
                singles_base,
                duration=phase.duration,
                seed=singles_base.seed + index,
                doc_rate=singles_cal.rate * phase.load,
            )
        )
        for session in (*chat.sessions, *singles.sessions):
            sessions.append(
                replace(session, id=f"{session.id}-{index}", start=session.start + offset)
            )
        offset += phase.duration
    calibration = CostCalibration(
        session_rate_at_capacity=chat_cal.rate / config.conversation_share,
        single_rate_at_capacity=singles_cal.rate / (1 - config.conversation_share),
    )
    workload = Workload(chat_base, tuple(sorted(sessions, key=lambda s: s.start)))
    return workload, calibration


def _paid_pool(port: int, config: CostConfig) -> dict[str, Any]:
    """The paid API as a pool: by DNS name, so kvpilot treats it as an external provider;
    priced per token, so kvpilot counts what it costs."""
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Pool",
        "metadata": {"name": PAID_POOL},
        "spec": {
            "models": [MODEL],
            "price": config.prices.pool_price(paid=True),
            "endpoints": [{"address": "localhost", "port": port}],
            "healthCheck": {"path": "/health", "interval": "1s", "timeout": "500ms"},
        },
    }


def _clusters(stack: Stack) -> set[str]:
    out = set()
    for config in stack.envoy.config_dump()["configs"]:
        for entry in config.get("dynamic_active_clusters", []):
            out.add(entry.get("cluster", {}).get("name", ""))
    return out


def _serving(stack: Stack, policy: Policy) -> bool:
    """Envoy has the policy's clusters and answers through them."""
    name = f"{POLICY_NAME}/chat"
    want = {name}
    if "overflow" in policy.route:
        want.add(f"{name}/overflow/{PAID_POOL}")
    if len(policy.route.get("tiers", [])) > 1:
        want.add(f"{name}/provider/{PAID_POOL}")
    with contextlib.suppress(Exception):
        if not want <= _clusters(stack):
            return False
        body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        return httpx.post(stack.url, json=body, timeout=10).status_code == 200
    return False


def run_one(
    stack: Stack,
    paid_url: str,
    policy: Policy,
    workload: Workload,
    config: CostConfig,
    requests: list[dict[str, Any]] | None = None,
) -> CostSummary:
    """Replay `workload` through `policy`; each request's outcome is appended to `requests`
    when given (``request_row``)."""
    print(f"\n== {policy.title}: {workload.requests} requests", flush=True)
    if policy.key == RESTART_POLICY:
        # Stopped, kvpilot writes its routes' prefill fits; started, a fresh fit continues
        # from them (controlplane.prefillfits).
        stack.kvpilot.stop()
        stack.kvpilot.start()
        wait_until(lambda: bool(_status(stack).get("envoys")), 60, "Envoy to reconnect")
    stack.put(policy_body(stack.listener_port, policy.route))
    wait_until(lambda: _serving(stack, policy), 60, f"Envoy to serve {policy.key}")
    ready_for_replay(stack, workload.system_prompts(), idle_timeout=120)
    httpx.post(f"{paid_url}/admin/reset", json={}, timeout=10).raise_for_status()
    if "overflow" in policy.route and "maxShare" not in policy.route["overflow"]:
        # The warm-up fills every replica with the long system prompts at once: start only
        # once the overflow has come back to nothing.
        wait_until(lambda: _overflow_idle(stack), 60, "the overflow to settle")
    if "overflow" in policy.route:
        print(f"   prefill weight at the start: {_prefill_weight(stack)}", flush=True)
    replicas = [(r.id, r.url) for r in stack.backends.replicas]
    # kvpilot's account starts after the warm-up and the probes, once their usage is in.
    before = spend.settled(stack.kvpilot.api_url, stack.token)
    run = asyncio.run(
        replay(
            workload,
            stack.url,
            model=MODEL,
            time_scale=config.routing.sim.time_scale,
            replicas=replicas,
            deadline=config.deadline,
            stop_at=config.duration,
            sample_interval=0.5,
        )
    )
    check = _spend_check(stack, run.results, before, config)
    if "overflow" in policy.route:
        print(f"   prefill weight at the end: {_prefill_weight(stack)}", flush=True)
    if requests is not None:
        requests.extend(request_row(policy.key, result) for result in run.results)
    summary = replace(summarize(run, config), spend=check)
    print(
        f"   {summary.ok}/{summary.requests} ok; TTFT p50 {summary.ttft_p50:.3f} "
        f"p99 {summary.ttft_p99:.3f} (peak p99 {summary.peak_ttft_p99:.3f}); "
        f"paid share of tokens {summary.paid_token_share:.1%}; "
        f"${summary.dollars_per_1k.paid:.4f} paid, "
        f"${summary.dollars_per_1k.owned:.4f} owned per 1,000 requests; "
        f"goodput {summary.goodput_per_s:.2f}/s ({run.wall_seconds:.0f}s wall); "
        f"paid $ in the replay {check.paid_dollars.kvpilot:.6f} by kvpilot, "
        f"{check.paid_dollars.responses:.6f} from the responses "
        f"({'they differ' if check.differences else 'equal'})",
        flush=True,
    )
    return summary


def request_row(policy: str, result: RequestResult) -> dict[str, Any]:
    """One request's outcome as a line of the run's requests file: which side answered it
    and when, its time to first token as the client and the engine saw it (their difference
    is the wait before the engine), its tokens."""
    return {
        "policy": policy,
        "session": result.session,
        "turn": result.turn,
        "start": round(result.start, 4),
        "replica": result.replica,
        "status": result.status,
        "error": result.error,
        "ttft": None if result.ttft is None else round(result.ttft, 4),
        "engine_ttft": None if result.engine_ttft is None else round(result.engine_ttft, 4),
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "completion_tokens": result.completion_tokens,
    }


def _spend_check(
    stack: Stack,
    results: list[Any],
    before: dict[str, spend.PoolSpend],
    config: CostConfig,
) -> SpendCheck:
    """kvpilot's spend over the replay beside the responses' usage at the same prices
    (``bench.cost.spend``), and where they differ."""
    responses = spend.from_responses(results, config.prices)
    after = spend.settled(
        stack.kvpilot.api_url,
        stack.token,
        expect=sum(s.requests for s in responses.values()),
        since=before,
    )
    counted = spend.between(after, before)
    differences = spend.differences(counted, responses)
    for line in differences:
        print(f"   SPEND DIFFERS: {line}", flush=True)
    hourly = spend.hourly(stack.kvpilot.api_url, stack.token, POOL)
    return SpendCheck(
        kvpilot={pool: s.as_json() for pool, s in sorted(counted.items())},
        responses={pool: s.as_json() for pool, s in sorted(responses.items())},
        differences=differences,
        paid_dollars=PaidDollars(
            kvpilot=float(counted.get(PAID_POOL, spend.PoolSpend()).cost),
            responses=float(responses.get(PAID_POOL, spend.PoolSpend()).cost),
        ),
        owned_hourly=OwnedHourly(
            kvpilot=None if hourly is None else float(hourly),
            config=config.replicas * config.prices.owned_per_replica_hour,
        ),
    )


def _status(stack: Stack) -> dict[str, Any]:
    with KvpilotClient(stack.kvpilot.api_url, token=stack.token) as client:
        return client.status()


def _prefill_weight(stack: Stack) -> str:
    """The route's prefill weight and where it comes from, as kvpilot's status says."""
    for entry in _status(stack).get("overflow", []):
        if entry.get("route") == f"{POLICY_NAME}/chat" and "prefillWeight" in entry:
            return f"{entry['prefillWeight']} ({entry['prefillWeightSource']})"
    return "none (overflow by the fill loop)"


def _overflow_idle(stack: Stack) -> bool:
    """kvpilot sends nothing to paid pools on the telemetry's word now."""
    text = httpx.get(f"{stack.kvpilot.api_url}/metrics", timeout=5).text
    shares = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("kvpilot_overflow_share{")
    ]
    return all(share == 0.0 for share in shares)


def run_cost(config: CostConfig, state_dir: Path | None = None) -> Path:
    """Run every policy on one seed; returns the Markdown report's path."""
    started = time.monotonic()
    workload, calibration = build_workload(config)
    print(f"workload: {workload.requests} requests ({time.monotonic() - started:.0f}s to build)")
    results: dict[str, CostSummary] = {}
    requests: list[dict[str, Any]] = []
    with contextlib.ExitStack() as exits:
        if state_dir is None:
            state_dir = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="kvcost-")))
        routing = replace(config.routing, replicas=config.replicas)
        print("starting etcd, kvpilot, simulated replicas, the paid API, Envoy and an agent ...")
        stack = exits.enter_context(start_stack(state_dir / "stack", routing))
        paid = exits.enter_context(
            BackendProcess(
                1,
                id_prefix=PAID_PREFIX,
                model=MODEL,
                state_dir=state_dir / "paid",
                simulator=config.paid_sim,
            ).start()
        )
        put_pool(stack, price=config.prices.pool_price(paid=False))
        stack.put(_paid_pool(paid.replicas[0].port, config))
        for policy in POLICIES:
            if policy.key not in config.policies if config.policies else not policy.default:
                continue
            results[policy.key] = run_one(
                stack, paid.replicas[0].url, config.policy(policy), workload, config, requests
            )
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = out / f"cost-{stamp}-seed{config.seed}.md"
    report.write_text(markdown({config.seed: results}, config))
    payload = {
        "config": {
            "replicas": config.replicas,
            "phases": [asdict(p) for p in config.phases],
            "conversation_share": config.conversation_share,
            "objective": config.objective,
            "seed": config.seed,
            "prices": asdict(config.prices),
            "paid_sim": asdict(config.paid_sim),
            "owned_sim": asdict(config.routing.sim),
            "excess_share": config.excess_share(),
            "overflow": config.overflow,
        },
        "calibration": asdict(calibration),
        "wall_seconds": time.monotonic() - started,
        "results": {policy: summary.to_json() for policy, summary in results.items()},
    }
    report.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str))
    # Every request of every policy, one JSON object a line: what the tables summarize.
    lines = "".join(json.dumps(row) + "\n" for row in requests)
    report.with_name(f"{report.stem}-requests.jsonl").write_text(lines)
    print(report.read_text())
    return report
