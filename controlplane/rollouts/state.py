"""A rollout's record in etcd, and what any replica reads of it.

The driver (``controlplane.rollouts.controller``) writes each rollout's progress at
``{prefix}/status/rollouts/{name}`` and consumes commands from
``{prefix}/status/rollout-commands/{name}``; every replica (status, metrics, the CLI through
the REST API) reads them from its etcd mirror with the functions here: the keys, which
command a phase allows, the current step's numbers and live verdict, the status summary and
the Prometheus gauges. The driver reads the same records from etcd itself before a decision
(``read_records``), so it commits against their current revisions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from compiler.rollout import (
    COMMANDS,
    PHASES,
    TERMINAL,
    PoolSignals,
    Verdict,
    evaluate,
    merge,
    target_cluster,
)
from controlplane.etcd import EtcdClient, KeyValue
from controlplane.etcd.keys import STATUS, Keys, decode_json
from controlplane.rollouts.signals import collect
from policies import PolicyError, Rollout, RoutingPolicy, parse_object

ROLLOUT_STATE_PREFIX = f"{STATUS}/rollouts/"
ROLLOUT_COMMAND_PREFIX = f"{STATUS}/rollout-commands/"
LEADER_JOB = "rollouts"


def state_key(name: str) -> str:
    return f"{ROLLOUT_STATE_PREFIX}{name}"


def command_key(name: str) -> str:
    return f"{ROLLOUT_COMMAND_PREFIX}{name}"


def allowed(command: str, phase: str | None) -> str | None:
    """Why ``command`` cannot apply in ``phase`` (None: it can)."""
    if phase in TERMINAL:
        return f"the rollout has ended ({phase}); delete and create it to run it again"
    if command == "pause" and phase == "Paused":
        return "the rollout is already paused"
    if command == "resume" and phase != "Paused":
        return "only a paused rollout can be resumed"
    return None


# --------------------------------------------------------------------------------------------
# Reading a rollout's numbers (any replica: status, metrics, the CLI)
# --------------------------------------------------------------------------------------------


def step_signals(
    items: Mapping[str, KeyValue], rollout: Rollout, state: Mapping[str, Any]
) -> dict[str, PoolSignals]:
    """Pool -> the step's numbers so far: every replica's counters minus the step's baseline
    (the canary fleets' alone while the step has reached only them)."""
    baseline = state.get("baseline") or {}
    now = collect(items, target_cluster(rollout), state.get("fleets"))
    per_replica = []
    for replica, pools in now.items():
        before = baseline.get(replica, {})
        per_replica.append(
            {
                pool: signals.since(PoolSignals.from_json(before.get(pool, {})))
                for pool, signals in pools.items()
            }
        )
    return merge(per_replica)


def canary_pools(rollout: Rollout, start: Mapping[str, int]) -> list[str]:
    """The pools weight moves to: the canary, or those the last step gives more than the start."""
    spec = rollout.spec
    if spec.canary is not None:
        return [spec.canary]
    last = spec.step_weights(len(spec.steps) - 1)
    return [pool for pool, weight in last.items() if weight > start.get(pool, 0)]


def judge(
    items: Mapping[str, KeyValue],
    rollout: Rollout,
    state: Mapping[str, Any],
    queried: Mapping[int, float | None] | None = None,
) -> Verdict:
    """The current step's verdict on the numbers in etcd now."""
    start = state.get("startWeights") or {}
    step = min(int(state.get("step", 0)), len(rollout.spec.steps) - 1)
    weights = rollout.spec.step_weights(step)
    canaries = canary_pools(rollout, start)
    pools = step_signals(items, rollout, state)
    canary = merge([{"c": pools.get(p, PoolSignals())} for p in canaries]).get("c", PoolSignals())
    stables = [p for p in rollout.spec.pools() if p not in canaries]
    stable = merge([{"s": pools.get(p, PoolSignals())} for p in stables]).get("s", PoolSignals())
    return evaluate(
        rollout.spec.analysis.rules,
        min_sample=rollout.spec.analysis.min_sample,
        canary=canary,
        stable=stable,
        stable_weight=sum(weights.get(p, 0) for p in stables),
        queried=queried,
    )


def summary(
    items: Mapping[str, KeyValue], rollout: Rollout, state: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What status shows of one rollout: phase, step, weights, and the live verdict."""
    spec = rollout.spec
    out: dict[str, Any] = {
        "name": rollout.metadata.name,
        "target": spec.target.model_dump(mode="json"),
        "steps": [spec.step_weights(i) for i in range(len(spec.steps))],
        "phase": "Pending",
        "step": None,
    }
    if not state:
        return out
    step = int(state.get("step", 0))
    out.update(
        {
            "phase": state.get("phase"),
            "step": step,
            "weights": spec.step_weights(min(step, len(spec.steps) - 1)),
            "stepStartedAt": state.get("stepStartedAt"),
            "minDuration": spec.steps[min(step, len(spec.steps) - 1)].min_duration,
            "message": state.get("message", ""),
            "driver": state.get("driver"),
            "failedRequests": state.get("failedRequests", 0),
            "fleets": state.get("fleets"),
        }
    )
    if state.get("phase") in ("Progressing", "Paused"):
        out["verdict"] = judge(items, rollout, state).as_json()
    else:
        out["verdict"] = state.get("verdict")
    return out


def rollout_states(
    items: Mapping[str, KeyValue],
) -> dict[str, tuple[Rollout, dict[str, Any] | None]]:
    """Every valid Rollout object in the mirror with its recorded state, by name."""
    out: dict[str, tuple[Rollout, dict[str, Any] | None]] = {}
    for key, kv in items.items():
        if not key.startswith("objects/rollouts/"):
            continue
        body = decode_json(kv)
        try:
            rollout = parse_object(body)
        except PolicyError:
            continue
        if not isinstance(rollout, Rollout):
            continue
        state_kv = items.get(state_key(rollout.metadata.name))
        state = decode_json(state_kv) if state_kv is not None else None
        if state is not None and state.get("object") != kv.create_revision:
            state = None  # the record of an earlier object of the same name
        out[rollout.metadata.name] = (rollout, state)
    return dict(sorted(out.items()))


class RolloutCollector(Collector):
    """Prometheus gauges of every rollout's phase and step, read from the etcd mirror."""

    def __init__(self, items: Any) -> None:
        self._items = items

    def collect(self) -> Any:
        phase = GaugeMetricFamily(
            "kvpilot_rollout_phase",
            "1 for the phase each rollout is in.",
            labels=["rollout", "phase"],
        )
        step = GaugeMetricFamily(
            "kvpilot_rollout_step", "Index of each rollout's current step.", labels=["rollout"]
        )
        weight = GaugeMetricFamily(
            "kvpilot_rollout_weight",
            "Each pool's weight (percent) at the rollout's current step.",
            labels=["rollout", "pool"],
        )
        for name, (rollout, state) in rollout_states(self._items()).items():
            current = (state or {}).get("phase") or "Pending"
            for value in PHASES:
                phase.add_metric([name, value], 1.0 if value == current else 0.0)
            if state:
                index = min(int(state.get("step", 0)), len(rollout.spec.steps) - 1)
                step.add_metric([name], float(index))
                for pool, w in rollout.spec.step_weights(index).items():
                    weight.add_metric([name, pool], float(w))
        yield phase
        yield step
        yield weight


def register_metrics(registry: CollectorRegistry, items: Any) -> None:
    registry.register(RolloutCollector(items))


@dataclass
class RolloutRead:
    """One rollout's records as read from etcd for a decision."""

    state: dict[str, Any] | None
    state_revision: int
    command: str | None
    command_revision: int
    policy: RoutingPolicy | None
    policy_revision: int


async def read_records(
    client: EtcdClient, keys: Keys, rollout: Rollout, created: int
) -> RolloutRead:
    """The rollout's record, its pending command and its target policy, read from etcd (not
    the mirror) for a decision the driver commits against their revisions."""
    name = rollout.metadata.name
    state_kv = await client.get(keys.absolute(state_key(name)))
    state = decode_json(state_kv) if state_kv is not None else None
    state_revision = state_kv.mod_revision if state_kv is not None else 0
    if state is not None and state.get("object") != created:
        state = None  # left by an earlier object of the same name: start over
    command_kv = await client.get(keys.absolute(command_key(name)))
    command_body = decode_json(command_kv) if command_kv is not None else None
    command = command_body.get("command") if command_body else None
    policy_kv = await client.get(
        keys.absolute(keys.object("RoutingPolicy", rollout.spec.target.policy))
    )
    policy: RoutingPolicy | None = None
    if policy_kv is not None:
        try:
            parsed = parse_object(decode_json(policy_kv))
        except PolicyError:
            parsed = None
        policy = parsed if isinstance(parsed, RoutingPolicy) else None
    return RolloutRead(
        state,
        state_revision,
        command if command in COMMANDS else None,
        command_kv.mod_revision if command_kv is not None else 0,
        policy,
        policy_kv.mod_revision if policy_kv is not None else 0,
    )
