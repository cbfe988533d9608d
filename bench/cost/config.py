"""The cost-aware overflow benchmark: what is run (the load, the pools and their prices, the
policies).

Four owned replicas with an hourly price and a paid API (a simulated OpenAI-compatible
endpoint with per-token prices, higher latency and a rate limit of its own) behind one
real Envoy configured by kvpilot. The offered load is a day in miniature: half the owned
capacity for a while, a rise in steps to 150%, a peak, a fall in steps, half again. It is
conversations (multi-turn chat with a session id, 60% of the load) and single requests
(a question about a shared document, no session, 40%).

Each policy replays the same requests, one after the other on the same stack:

- owned only: the owned replicas alone;
- static split: 20% of every kind of request to the paid API, always (overflow with
  ``minShare = maxShare = 20``, ``conversations: with``);
- failover only: the paid API as a failover tier (taken when the owned replicas are
  unhealthy, or by retries of failed requests);
- cost-aware overflow: ``overflow`` with its defaults (the paid API takes the excess
  while the owned replicas are saturated, requests without a session first);
- cost-aware + feed-forward (run only when named with ``--policies``): the same with
  ``feedForward: 0.5``, the replicas' excess demand added each round at half weight;
- cost-aware by arrivals (run only when named with ``--policies``): ``signal: arrivals``,
  the paid share from the route's arrival rate against the owned replicas' capacity
  measured at full batches (``signals.overflowff``), with the benchmark's TTFT objective
  (``ttft: 1s``) so that a queue beyond it is drained to the paid API; and (also only when
  named) the same with an objective of 2 s, which holds a longer queue on the owned replicas;
- the loop giving back sooner (run only when named): ``recoverInterval: 2s``, and the same
  with ``low: 0.9``; and by arrivals with ``recoverInterval: 2s``;
- by arrivals with the owned replicas kept at 97% or 80% of their measured capacity (run
  only when named, ``cost_aware_arrivals_u97`` and ``_u80``: ``utilization``, 0.9 by
  default);
- by arrivals with the prefill weight set to the simulated engine's own ratio (run only when
  named, ``cost_aware_arrivals_w``: ``prefillWeight``), where a kvpilot that has learned it
  stands;
- with a gate (``GATE_POLICIES``: ``maxInFlight`` at the owned replicas' batch slots or
  75-95% of them, by arrivals or alone with ``maxShare: 0``; 90% by arrivals in every run,
  ``DEFAULT_GATE``, the others when named): a request without a session that finds the gate
  full goes to the paid API at once.

Capacity is what the owned replicas serve at full batches with perfect affinity (every
request hits all that was computed before it): an upper bound, so 150% of it is more than
they can serve (`bench.cost.run.build_workload`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.rig.phased import Phased, paced
from bench.rig.routes import SESSION_AFFINITY, Policy
from bench.rig.stack import POOL
from bench.rig.workload import CHAT, WorkloadConfig
from bench.routing.scenarios import SUITE_MAX_BATCH, sim_at
from bench.routing.sequential import RoutingConfig as BenchConfig
from bench.routing.sequential import default_config as routing_config
from replicasim.simulator import SimConfig

PAID_POOL = "paid"
PAID_PREFIX = "paid"
"""Replica id prefix of the paid API's simulated replica (``x-backend-id``)."""


@dataclass(frozen=True)
class Phase:
    """A stretch of the run at one offered load, a share of the owned capacity."""

    name: str
    duration: float
    load: float
    measured: bool = True


@dataclass(frozen=True)
class Prices:
    """What the benchmark pays: written into the pools' ``price`` (``pool_price``), so
    kvpilot prices the responses itself, and used by the load generator's own account of
    the same responses (``bench.cost.spend``)."""

    owned_per_replica_hour: float = 2.50
    """An owned GPU replica, dollars per hour, busy or idle."""
    paid_input_per_mtok: float = 0.20
    """Paid API, uncached prompt tokens, dollars per million."""
    paid_cached_input_per_mtok: float = 0.10
    """Paid API, cached prompt tokens, dollars per million."""
    paid_output_per_mtok: float = 0.60
    """Paid API, completion tokens, dollars per million."""

    def pool_price(self, paid: bool) -> dict[str, str]:
        """The Pool ``price`` of the paid API (per token) or of an owned replica (per hour),
        each number in its shortest decimal form, as kvpilot reads numbers."""
        if not paid:
            return {"currency": "USD", "replicaHour": str(self.owned_per_replica_hour)}
        return {
            "currency": "USD",
            "input": str(self.paid_input_per_mtok),
            "cachedInput": str(self.paid_cached_input_per_mtok),
            "output": str(self.paid_output_per_mtok),
        }

    def paid(self, prompt: int, cached: int, completion: int) -> float:
        """Dollars one paid request costs."""
        uncached = max(0, prompt - cached)
        return (
            uncached * self.paid_input_per_mtok
            + cached * self.paid_cached_input_per_mtok
            + completion * self.paid_output_per_mtok
        ) / 1e6


ROUTE: dict[str, Any] = {"balancing": "telemetry", "sessionAffinity": dict(SESSION_AFFINITY)}
"""The owned replicas' route in every policy: session affinity with telemetry weights."""

ENGINE_WEIGHT_POLICY = "cost_aware_arrivals_w"
"""The policy run with ``overflow.prefillWeight`` at the simulated engine's own ratio."""
GATED_OVERFLOW: dict[str, Any] = {"pools": [PAID_POOL], "signal": "arrivals", "ttft": "1s"}
GATE_POLICIES: dict[str, tuple[str, float, dict[str, Any]]] = {
    "cost_aware_gate": ("cost-aware by arrivals, a gate at the batch slots", 1.0, {}),
    "cost_aware_gate_75": ("cost-aware by arrivals, a gate at 75% of them", 0.75, {}),
    "cost_aware_gate_85": ("cost-aware by arrivals, a gate at 85% of them", 0.85, {}),
    "cost_aware_gate_90": ("cost-aware by arrivals, a gate at 90% of them", 0.9, {}),
    "cost_aware_gate_95": ("cost-aware by arrivals, a gate at 95% of them", 0.95, {}),
    "cost_aware_gate_with": (
        "cost-aware by arrivals, a gate, conversations with the rest",
        1.0,
        {"conversations": "with"},
    ),
    "gate_only": ("a gate at the batch slots alone (no share)", 1.0, {"maxShare": 0}),
    "gate_only_75": ("a gate at 75% of the batch slots alone", 0.75, {"maxShare": 0}),
    "gate_only_90": ("a gate at 90% of the batch slots alone", 0.9, {"maxShare": 0}),
}
"""Routes with a gate (``overflow.maxInFlight``): key -> (label, the gate's share of the owned
replicas' batch slots, overflow fields): a request without a session that finds the gate
full goes to the paid API at once."""
DEFAULT_GATE = "cost_aware_gate_90"
"""The gated route every run has (the others run when named): at 90% of the slots, where the
benchmark met its targets (docs/cost-overflow.md)."""
RESTART_POLICY = "cost_aware_arrivals_restart"
"""The default route replayed by a kvpilot just restarted: its prefill fit is the one the
previous policies' runs left in etcd (run after ``cost_aware_arrivals``)."""


def engine_weight(sim: SimConfig) -> float:
    """What a prefilled token costs the simulated engine against an output token at a full
    batch: its prefill time per token over a full step's time per sequence (0.086 at 8, 0.24
    at 32 with the benchmark's engine), what ``signals.prefillfit`` learns from its counters."""
    step = sim.decode_base + sim.decode_per_seq * sim.max_batch
    return round(sim.prefill_per_token / (step / sim.max_batch), 4)


POLICIES: tuple[Policy, ...] = (
    Policy("owned_only", "owned only", ROUTE),
    Policy(
        "static_split",
        "static split (20% paid)",
        {
            **ROUTE,
            "overflow": {
                "pools": [PAID_POOL],
                "signal": "fill",
                "minShare": 20,
                "maxShare": 20,
                "conversations": "with",
            },
        },
    ),
    Policy("failover_only", "failover only", {**ROUTE, "tiers": [[POOL], [PAID_POOL]]}),
    # The fill loop (`signal: fill`, the default before overflow by arrivals).
    Policy(
        "cost_aware",
        "cost-aware, the loop (signal: fill)",
        {**ROUTE, "overflow": {"pools": [PAID_POOL], "signal": "fill"}},
    ),
    Policy(
        "cost_aware_ff",
        "cost-aware + feed-forward 0.5",
        {**ROUTE, "overflow": {"pools": [PAID_POOL], "signal": "fill", "feedForward": 0.5}},
        default=False,
    ),
    Policy(
        "cost_aware_arrivals",
        "cost-aware by arrivals (the default signal)",
        {**ROUTE, "overflow": {"pools": [PAID_POOL], "signal": "arrivals", "ttft": "1s"}},
    ),
    # The loop giving back sooner: a step each 2 s instead of 5 (a telemetry scrape is 1 s),
    # and, in the second, from a pressure of 0.9 instead of 0.8 (a narrower band). Where the
    # loop's paid spend after the peak goes.
    Policy(
        "cost_aware_r2",
        "cost-aware, recover 2 s",
        {**ROUTE, "overflow": {"pools": [PAID_POOL], "signal": "fill", "recoverInterval": "2s"}},
        default=False,
    ),
    Policy(
        "cost_aware_r2_low9",
        "cost-aware, recover 2 s, low 0.9",
        {
            **ROUTE,
            "overflow": {
                "pools": [PAID_POOL],
                "signal": "fill",
                "recoverInterval": "2s",
                "low": 0.9,
            },
        },
        default=False,
    ),
    # By arrivals giving back sooner: a share held 2 s after its last change instead of 5.
    # The hold is the largest share of the last seconds' rounds; with a demand that no
    # longer dips as the split moves, what it buys at the peak against what it costs.
    Policy(
        "cost_aware_arrivals_r2",
        "cost-aware by arrivals, recover 2 s",
        {
            **ROUTE,
            "overflow": {
                "pools": [PAID_POOL],
                "signal": "arrivals",
                "ttft": "1s",
                "recoverInterval": "2s",
            },
        },
        default=False,
    ),
    # By arrivals with the owned replicas kept at another share of their capacity
    # (``utilization``, 0.9 by default): 0.97, the default before, pays for fewer requests
    # and holds a longer queue at the peak; 0.8 the other way. Side by side with the
    # default, the trade between the two targets.
    *(
        Policy(
            f"cost_aware_arrivals_u{round(share * 100)}",
            f"cost-aware by arrivals, utilization {share}",
            {
                **ROUTE,
                "overflow": {
                    "pools": [PAID_POOL],
                    "signal": "arrivals",
                    "ttft": "1s",
                    "utilization": share,
                },
            },
            default=False,
        )
        for share in (0.97, 0.8)
    ),
    # The default route again, replayed by a kvpilot stopped and started just before: the
    # fit that ``cost_aware_arrivals``' run learned is kept in etcd, and the route's fresh
    # fit continues from it (``controlplane.prefillfits``). What a restart costs a route
    # whose kvpilot had learned; named after ``cost_aware_arrivals`` to follow it.
    Policy(
        RESTART_POLICY,
        "cost-aware by arrivals, kvpilot restarted (its fit kept in etcd)",
        {**ROUTE, "overflow": {"pools": [PAID_POOL], "signal": "arrivals", "ttft": "1s"}},
        default=False,
    ),
    # By arrivals with the prefill weight the engines have (``prefillWeight``, set per run
    # from the simulated engine at its batch size: ``engine_weight``): where a kvpilot that
    # has learned it stands, against the default that starts from 0.1 (a cold kvpilot
    # learns it only after minutes of full batches, longer than this run).
    Policy(
        ENGINE_WEIGHT_POLICY,
        "cost-aware by arrivals, the engines' prefill weight",
        {**ROUTE, "overflow": {"pools": [PAID_POOL], "signal": "arrivals", "ttft": "1s"}},
        default=False,
    ),
    # The default route with a gate (``maxInFlight``, set per run from the replicas and
    # their batch: ``CostConfig.policy``): the first seconds of a peak, which the share
    # follows only later, go to the paid API request by request. At the batch slots or
    # 75-95% of them; with the share (by arrivals) or with the gate alone (``maxShare: 0``).
    *(
        Policy(
            key,
            label,
            {**ROUTE, "overflow": {**GATED_OVERFLOW, **fields}},
            default=key == DEFAULT_GATE,
        )
        for key, (label, _, fields) in GATE_POLICIES.items()
    ),
    # The same with an objective twice the benchmark's: a longer queue is held on the owned
    # replicas before it is drained. Where the objective sits between paid spend and the
    # peak's latency.
    Policy(
        "cost_aware_arrivals_2s",
        "cost-aware by arrivals, objective 2 s",
        {**ROUTE, "overflow": {"pools": [PAID_POOL], "signal": "arrivals", "ttft": "2s"}},
        default=False,
    ),
)


@dataclass(frozen=True)
class CostConfig(Phased):
    """One run of the cost benchmark (every policy, one seed; its timeline from `Phased`)."""

    replicas: int = 4
    phases: tuple[Phase, ...] = (
        Phase("ramp", 10.0, 0.5, measured=False),
        Phase("base", 30.0, 0.5),
        Phase("rise-1", 5.0, 0.75),
        Phase("rise-2", 5.0, 1.0),
        Phase("rise-3", 5.0, 1.25),
        Phase("peak", 15.0, 1.5),
        Phase("fall-1", 5.0, 1.25),
        Phase("fall-2", 5.0, 1.0),
        Phase("fall-3", 5.0, 0.75),
        Phase("after", 30.0, 0.5),
    )
    conversation_share: float = 0.6
    """Share of the load that is conversations; the rest is single requests."""
    objective: float = 1.0
    """TTFT objective, simulated seconds: goodput counts the requests within it."""
    seed: int = 1
    prices: Prices = field(default_factory=Prices)
    paid_sim: SimConfig = field(
        default_factory=lambda: SimConfig(
            max_batch=256,
            kv_blocks=65536,
            time_scale=1.0,
            stream_interval=1.0,
            first_token_delay=0.4,
            rate_limit=40.0,
        )
    )
    """The paid API: a large batch, 0.4 s before a request reaches its engine, 40 requests
    a second."""
    deadline: float = 400.0
    """Wall-clock limit of one policy's replay."""
    out_dir: Path = Path("bench/results")
    routing: BenchConfig = field(default_factory=lambda: routing_config())
    policies: tuple[str, ...] = ()
    """Keys of the policies to run; empty: all."""
    overflow: dict[str, Any] = field(default_factory=dict)
    """Fields added to cost-aware overflow's ``overflow`` (empty: its defaults)."""

    def policy(self, policy: Policy) -> Policy:
        """`policy` as this run applies it."""
        if policy.key == ENGINE_WEIGHT_POLICY:
            overflow = {
                **policy.route["overflow"],
                "prefillWeight": engine_weight(self.routing.sim),
            }
            return replace(policy, route={**policy.route, "overflow": overflow})
        if policy.key in GATE_POLICIES:
            slots = self.routing.replicas * self.routing.sim.max_batch
            share = GATE_POLICIES[policy.key][1]
            overflow = {**policy.route["overflow"], "maxInFlight": round(slots * share)}
            return replace(policy, route={**policy.route, "overflow": overflow})
        if policy.key != "cost_aware" or not self.overflow:
            return policy
        overflow = {**policy.route["overflow"], **self.overflow}
        return replace(policy, route={**policy.route, "overflow": overflow})

    def excess_share(self) -> float:
        """The least share of the measured load that must go somewhere other than the owned
        replicas for them to stay within capacity: what any policy that keeps its latency
        buys at least (capacity as estimated, an upper bound: the real excess is larger)."""
        measured = [p for p in self.phases if p.measured]
        total = sum(p.load * p.duration for p in measured)
        excess = sum(max(0.0, p.load - 1.0) * p.duration for p in measured)
        return excess / total if total else 0.0


SINGLES = WorkloadConfig(
    kind="docs",
    documents=(400, 800, 1200, 1600, 2000, 2400),
    question_median=80,
    answer_median=150,
    length_cap=400,
)
"""Single requests: a question about one of a few shared documents, no session id."""


def default_config(short: bool = False, seed: int = 1, batch: int = SUITE_MAX_BATCH) -> CostConfig:
    """The `make bench` settings, or a smoke run with `short`; the owned replicas batch
    `batch` sequences (the load follows their capacity at that batch size)."""
    # Paced as the service-class benchmark's fleet is (`bench.rig.phased.paced`).
    # The KV cache grows with the batch (`sim_at`: the same cache per sequence); the pace
    # stays the wall clock's, so the control plane's seconds are the engines' seconds.
    sim = sim_at(routing_config().sim, batch)
    base = paced(BenchConfig(replicas=4, sim=sim, workload=CHAT), batch, orca=False)
    config = CostConfig(routing=base, seed=seed)
    if short:
        config = CostConfig(
            routing=base,
            seed=seed,
            phases=(
                Phase("ramp", 4.0, 0.5, measured=False),
                Phase("base", 6.0, 0.5),
                Phase("peak", 8.0, 1.5),
                Phase("after", 6.0, 0.5),
            ),
            deadline=90.0,
        )
    return config
