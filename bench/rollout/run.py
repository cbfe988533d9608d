"""The rollout benchmark: a bad canary during multi-turn chat at 70% load, caught by a
progressive rollout versus a blind 90/10 split of the same canary.

One embedded etcd, one ``kvpilot serve``, one real Envoy, three stable simulated vLLM replicas
and one canary replica that answers 500 to one request in five. The same calibrated multi-turn
workload (session affinity, bounded load) is replayed twice:

- ``blind``: the route's tier is set to stable 90 / canary 10 and left there;
- ``rollout``: the tier starts at stable 100 and a Rollout moves 10 -> 25 -> 50 -> 100 with an
  errorRate rule read from Envoy's upstream access logs.

Retries are off in both runs, so every canary failure reaches a client: the worst case, and
the number the comparison is about. Reported per run: requests failed, requests the canary
answered, TTFT of those, time from the rollout's first step to its rollback (time to detect),
and sessions whose replica changed at each step change (forced: to or from the canary;
unforced: from one stable replica to another).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from api.client import KvpilotClient
from bench.rig.loadgen import RequestResult, replay
from bench.rig.report import table
from bench.rig.routes import SESSION_AFFINITY
from bench.rig.stack import MODEL, chat_url, say
from bench.rig.summary import percentile
from bench.rig.workload import Workload
from bench.routing.results import Calibration
from bench.routing.sequential import RoutingConfig, calibrate, default_config
from controlplane.local import LocalStack, free_port, local_stack, wait_until
from controlplane.local.replicas import BackendProcess

CANARY_FAILURE = {"status": 500, "fraction": 0.2}
STEPS = (10, 25, 50, 100)
STEP_SECONDS = 10.0
MIN_SAMPLE = 10


@dataclass
class Rig:
    local: LocalStack
    stable: BackendProcess
    canary: BackendProcess
    port: int

    @property
    def url(self) -> str:
        return chat_url(self.port)

    def client(self) -> KvpilotClient:
        return KvpilotClient(self.local.kvpilot.api_url, token=self.local.admin_token)


@contextlib.contextmanager
def start(state_dir: Path, config: RoutingConfig) -> Iterator[Rig]:
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(
            local_stack(state_dir, node_id="bench-envoy", etcd_args=["--unsafe-no-fsync"])
        )
        stable, canary = (
            stack.enter_context(
                BackendProcess(
                    n,
                    id_prefix=prefix,
                    model=MODEL,
                    state_dir=state_dir / prefix,
                    simulator=config.sim,
                ).start()
            )
            for n, prefix in ((3, "stable"), (1, "canary"))
        )
        yield Rig(local, stable, canary, free_port())


def _pool(name: str, backends: BackendProcess) -> dict[str, Any]:
    return {
        "kind": "Pool",
        "metadata": {"name": name},
        "spec": {
            "models": [MODEL],
            "endpoints": [{"address": r.host, "port": r.port} for r in backends.replicas],
            "healthCheck": {"interval": "1s"},
            # Keep the bad canary in rotation: the comparison is about what the split and the
            # rollout do, not about outlier detection.
            "outlierDetection": {"enabled": False},
        },
    }


def _policy(port: int, canary_weight: int) -> dict[str, Any]:
    return {
        "kind": "RoutingPolicy",
        "metadata": {"name": "chat"},
        "spec": {
            "listener": {"address": "127.0.0.1", "port": port},
            "routes": [
                {
                    "name": "chat",
                    "tiers": [
                        {
                            "pools": [
                                {"pool": "stable", "weight": 100 - canary_weight},
                                {"pool": "canary", "weight": canary_weight},
                            ]
                        }
                    ],
                    "sessionAffinity": dict(SESSION_AFFINITY),
                    "retries": {"attempts": 0},
                }
            ],
        },
    }


def _rollout() -> dict[str, Any]:
    return {
        "kind": "Rollout",
        "metadata": {"name": "canary"},
        "spec": {
            "target": {"policy": "chat", "route": "chat"},
            "stable": "stable",
            "canary": "canary",
            "steps": [{"weight": w, "minDuration": STEP_SECONDS} for w in STEPS],
            "analysis": {
                "minSample": MIN_SAMPLE,
                "rules": [{"metric": "errorRate", "max": 0.05}],
            },
        },
    }


def _canary_share(rig: Rig) -> int:
    """The canary's share of the route's endpoint weight in Envoy, in percent."""
    canary_ports = {r.port for r in rig.canary.replicas}
    total = mine = 0
    for line in rig.local.envoy.clusters().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "chat/chat" and parts[2] == "weight":
            weight = int(parts[3])
            total += weight
            if int(parts[1].rsplit(":", 1)[1]) in canary_ports:
                mine += weight
    return round(100 * mine / total) if total else -1


def _serving(rig: Rig) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    return httpx.post(rig.url, json=body, timeout=10).status_code == 200


def _prepare(rig: Rig, canary_weight: int) -> None:
    client = rig.client()
    with contextlib.suppress(Exception):
        client.delete("Rollout", "canary")
    for replica in rig.canary.replicas:
        httpx.post(f"{replica.url}/admin/fail", json={"status": 0}, timeout=5)
    client.put(_pool("stable", rig.stable))
    client.put(_pool("canary", rig.canary))
    client.put(_policy(rig.port, canary_weight))
    wait_until(
        lambda: _canary_share(rig) == canary_weight,
        60,
        f"Envoy at {canary_weight}% canary",
        ignoring=(httpx.HTTPError,),
    )
    wait_until(lambda: _serving(rig), 30, "a request through Envoy", ignoring=(httpx.HTTPError,))
    rig.stable.reset()
    rig.canary.reset()
    for replica in rig.canary.replicas:
        httpx.post(f"{replica.url}/admin/fail", json=CANARY_FAILURE, timeout=5)


@dataclass
class Moves:
    """Sessions with a turn on each side of one weight change."""

    forced: int = 0
    """Moved to or from the canary."""
    unforced: int = 0
    """Moved between stable replicas."""
    stayed: int = 0
    """Kept their replica."""


@dataclass
class ArmResult:
    """One arm's numbers (the blind split, or the rollout)."""

    requests: int
    failed: int
    failed_500: int
    canary_answered: int
    ttft_p50_stable: float | None
    ttft_p50_canary: float | None
    wall_seconds: float = 0.0
    phase: str | None = None
    """The rollout's phase at the end (the rollout arm only, as are the fields below)."""
    steps_reached: list[int] | None = None
    """The canary's weight at each step taken."""
    reported_canary_failures: int | None = None
    """The failed canary requests the rollout's status counted."""
    time_to_detect_s: float | None = None
    """From the first step to the rollback, when there was one."""
    sessions_moved: dict[str, Moves] | None = None
    """Per weight change (``to 25%``, ``rollback``), the sessions it moved."""


def _moves(results: list[RequestResult], changes: list[float], canary_ids: set[str]) -> list[Moves]:
    """Per weight change (simulated time), sessions whose consecutive answered turns straddle
    it and came from different replicas: to/from the canary (forced) or stable to stable."""
    by_session: dict[str, list[RequestResult]] = {}
    for result in results:
        if result.ok:
            by_session.setdefault(result.session, []).append(result)
    out = [Moves() for _ in changes]
    for turns in by_session.values():
        turns.sort(key=lambda r: r.start)
        for before, after in itertools.pairwise(turns):
            crossed = [i for i, at in enumerate(changes) if before.start < at <= after.start]
            if not crossed:
                continue
            index = crossed[-1]
            if before.replica == after.replica:
                out[index].stayed += 1
            elif before.replica in canary_ids or after.replica in canary_ids:
                out[index].forced += 1
            else:
                out[index].unforced += 1
    return out


def _summary(results: list[RequestResult], canary_ids: set[str]) -> ArmResult:
    failed = [r for r in results if r.status != 200]
    canary = [r for r in results if r.replica in canary_ids]
    stable_ttft = [r.ttft for r in results if r.ok and r.replica not in canary_ids and r.ttft]
    canary_ttft = [r.ttft for r in canary if r.ok and r.ttft]
    return ArmResult(
        requests=len(results),
        failed=len(failed),
        failed_500=sum(1 for r in failed if r.status == 500),
        canary_answered=len(canary),
        ttft_p50_stable=percentile(stable_ttft, 50),
        ttft_p50_canary=percentile(canary_ttft, 50),
    )


def run_arm(rig: Rig, workload: Workload, config: RoutingConfig, arm: str) -> ArmResult:
    say(f"\n== {arm}")
    _prepare(rig, 10 if arm == "blind" else 0)
    canary_ids = {r.id for r in rig.canary.replicas}
    client = rig.client()
    t0 = time.time()
    if arm == "rollout":
        client.put(_rollout())
    run = asyncio.run(
        replay(
            workload,
            rig.url,
            model=MODEL,
            time_scale=config.sim.time_scale,
            deadline=config.deadline,
        )
    )
    summary = _summary(run.results, canary_ids)
    summary.wall_seconds = round(run.wall_seconds, 1)
    if arm == "rollout":
        status = client._request("GET", "/v1/rollouts/canary/status").json()
        history = status.get("history", [])
        steps = [e for e in history if e["event"] == "step"]
        rollback = next((e for e in history if e["event"] == "rollback"), None)
        summary.phase = status.get("phase")
        summary.steps_reached = [e["weights"]["canary"] for e in steps]
        summary.reported_canary_failures = status.get("failedRequests")
        if rollback is not None and steps:
            summary.time_to_detect_s = round(rollback["at"] - steps[0]["at"], 2)
        changes = [e["at"] for e in steps] + ([rollback["at"]] if rollback else [])
        sim_changes = [(at - t0) / config.sim.time_scale for at in changes]
        labels = [f"to {e['weights']['canary']}%" for e in steps] + (
            ["rollback"] if rollback else []
        )
        summary.sessions_moved = dict(
            zip(labels, _moves(run.results, sim_changes, canary_ids), strict=True)
        )
    say("   " + json.dumps(asdict(summary)))
    return summary


def default_rollout_config(short: bool = False) -> RoutingConfig:
    base = default_config(short=short)
    workload = replace(base.workload, duration=30.0 if short else 150.0)
    return replace(base, workload=workload, target_load=0.7, plots=False)


def markdown(results: dict[str, ArmResult], calibration: Calibration) -> str:
    blind, rollout = results["blind"], results["rollout"]
    detect = "-" if rollout.time_to_detect_s is None else rollout.time_to_detect_s
    lines = [
        "# Rollout benchmark: a bad canary (500 on 20% of requests)",
        "",
        f"Multi-turn chat at 70% of cache-blind capacity ({calibration.to_json()}), 3 stable replicas "
        "and 1 canary, session affinity with bounded load, retries off.",
        "",
        *table(
            ("run", "requests", "failed", "canary answered", "time to detect", "steps reached"),
            (
                (
                    "blind 90/10 split",
                    blind.requests,
                    blind.failed,
                    blind.canary_answered,
                    "never",
                    "",
                ),
                (
                    "kvpilot rollout 10/25/50/100",
                    rollout.requests,
                    rollout.failed,
                    rollout.canary_answered,
                    f"{detect} s",
                    f"{rollout.steps_reached} ({rollout.phase})",
                ),
            ),
            "lrrrrl",
        ),
        "",
        "Sessions moved at each weight change (forced: to or from the canary; unforced: "
        "between stable replicas; stayed: kept their replica):",
        "",
    ]
    for label, moved in (rollout.sessions_moved or {}).items():
        lines.append(f"- {label}: {asdict(moved)}")
    if blind.failed:
        lines += [
            "",
            f"Failed requests, rollout / blind: {rollout.failed / blind.failed:.2f}",
        ]
    return "\n".join(lines) + "\n"


def run_rollout_bench(config: RoutingConfig, state_dir: Path | None = None) -> Path:
    """Both runs side by side; returns the Markdown report's path."""
    workload, calibration = calibrate(replace(config, replicas=4), config.workload)
    say(f"workload: {workload.requests} requests, {calibration.to_json()}")
    with contextlib.ExitStack() as stack:
        if state_dir is None:
            import tempfile

            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        rig = stack.enter_context(start(state_dir, config))
        results = {arm: run_arm(rig, workload, config, arm) for arm in ("blind", "rollout")}
    config.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = config.out_dir / f"rollout-{stamp}.md"
    report.write_text(markdown(results, calibration))
    report.with_suffix(".json").write_text(
        json.dumps(
            {
                "calibration": calibration.to_json(),
                "results": {k: asdict(v) for k, v in results.items()},
            },
            indent=2,
        )
    )
    return report
