"""The service-class benchmark: what is run (phases, policies, workloads).

Interactive chat keeps its latency while batch overloads the fleet, through a real Envoy
configured by kvpilot: the same stack as the routing benchmark (embedded etcd, ``kvpilot
serve``, simulated vLLM replicas, a real Envoy, ``kvpilot agent`` writing telemetry), with
8 replicas. Each policy replays the same requests in phases (simulated seconds):

0. ramp, not measured: the calm load from an empty fleet, until conversations of every
   age are in flight (sessions last most of a minute);
1. calm: interactive multi-turn chat at 40% of capacity plus batch at 10% (50% in all);
2. overload: interactive at 60% plus batch pushing the total to 130%;
3. calm again at 50%.

Capacity is what the replicas serve with full batches, estimated cache-blind (round
robin's ceiling, as in the scenario suite), and the replicas batch 8 sequences at most
(``SUITE_MAX_BATCH``): with 32-sequence batches and capacity taken at half batches,
"130%" kept the engines short of full batches, and affinity alone served every batch
request within its objective. No turn is sent after the last phase ends. Batch requests
are single long prompts without a session id, sent with ``x-priority: batch`` and one of a
few tenants; shed requests are not retried. Policies: round robin, session affinity alone,
and session affinity with service classes (batch shed, or queued in Envoy, while the pool
is saturated). A first run, the reference, replays the interactive requests alone under
affinity.

`bench.classes.run` runs it, `bench.classes.report` reports per class and policy (TTFT
p50/p99, goodput, shed and diverted counts, errors, time to recover, the engines' own
running and waiting counts per phase, the issue's targets as met / not met rows), and
`bench.classes.signals` records the pool's signals and which of them leads the
interactive class's time to first token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.rig.loadgen import RequestResult
from bench.rig.phased import Phased, paced
from bench.rig.routes import Policy, standard_policies
from bench.rig.stack import POOL
from bench.rig.workload import Session, Workload, WorkloadConfig, generate
from bench.routing.scenarios import SUITE_MAX_BATCH
from bench.routing.sequential import RoutingConfig, calibrate
from bench.routing.sequential import default_config as routing_config

INTERACTIVE, BATCH = "interactive", "batch"
BATCH_HEADER = ("x-priority", "batch")
"""The header every batch request carries, which the batch class matches."""
LANE_POOL = f"{POOL}-batch"
"""The pool of a batch lane's replicas."""
TENANTS = ("evals", "nightly-etl", "backfill")


@dataclass(frozen=True)
class Phase:
    """A stretch of the run: its length (simulated seconds) and offered loads, as shares of
    the fleet's cache-blind capacity."""

    name: str
    duration: float
    interactive: float
    batch: float
    measured: bool = True
    """False for the ramp: its requests load the fleet but count in no number."""


@dataclass(frozen=True)
class ClassesConfig(Phased):
    """One run of the service-class benchmark (its timeline from `Phased`)."""

    replicas: int = 8
    phases: tuple[Phase, ...] = (
        Phase("ramp", 20.0, 0.4, 0.1, measured=False),
        Phase("calm", 10.0, 0.4, 0.1),
        Phase("overload", 30.0, 0.6, 0.7),
        Phase("recovery", 20.0, 0.4, 0.1),
    )
    objectives: dict[str, float] = field(default_factory=lambda: {INTERACTIVE: 1.0, BATCH: 30.0})
    """TTFT objective of each class, simulated seconds: goodput counts requests within it."""
    service_classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The policy's serviceClasses, by the key of each policy that has them (see
    `default_config`)."""
    client_ttft_classes: tuple[str, ...] = (BATCH,)
    """Classes whose objective is checked on the client's TTFT, which includes any wait in
    Envoy's queue (the engine's starts at the replica): batch's 30 s dwarfs the seconds a
    busy load generator adds, interactive's 1 s does not, and interactive never waits in
    Envoy."""
    deadline: float = 300.0
    """Wall-clock limit of one policy's replay."""
    out_dir: Path = Path("bench/results")
    routing: RoutingConfig = field(default_factory=lambda: routing_config())
    """The routing benchmark's simulator, chat workload and agent settings, reused."""
    policies: tuple[str, ...] = ()
    """Keys of the policies to run after the reference (`POLICIES`); empty: those run by
    default."""
    lanes: dict[str, int] = field(default_factory=dict)
    """Replicas set aside for batch, by the key of each policy that has a batch lane: the
    last that many replicas form a pool of their own, which a route for the batch class
    takes, and the interactive route takes the others."""

    @property
    def peak(self) -> Phase:
        """The overload: the phase with the most offered load."""
        return max(self.phases, key=lambda phase: phase.interactive + phase.batch)


_AFFINITY = standard_policies()["affinity"]
POLICIES: tuple[Policy, ...] = (
    standard_policies()["round_robin"],
    replace(_AFFINITY, title="affinity alone"),
    replace(_AFFINITY, key="classes", title="affinity + service classes, batch shed"),
    replace(_AFFINITY, key="classes_queue", title="affinity + service classes, batch queued"),
    replace(
        _AFFINITY,
        key="classes_lane",
        title="affinity + service classes, batch on a lane of its own, shed",
    ),
    # Sensitivity, run only when named: the same shedding with the engines' TTFT, which
    # mixes the classes, as good as out of the rule (a bound of 2 s), so the queue decides.
    replace(
        _AFFINITY,
        key="classes_queue_bound",
        title="affinity + service classes, batch shed on the queue alone",
        default=False,
    ),
    # Sensitivity, run only when named: the same shedding with the queue and KV-cache use
    # read over the whole pool rather than its busiest quarter (`Saturation.busiest`).
    replace(
        _AFFINITY,
        key="classes_mean",
        title="affinity + service classes, batch shed on the pool mean",
        default=False,
    ),
)
CLASS_POLICIES = (
    "classes",
    "classes_queue",
    "classes_lane",
    "classes_queue_bound",
    "classes_mean",
)
"""The policies with service classes, each checked against the targets."""
REFERENCE = replace(_AFFINITY, key="reference", title="affinity, interactive alone (no batch)")


def default_config(short: bool = False) -> ClassesConfig:
    """The `make bench BENCH_ARGS=classes` settings, or a smoke run with `short`."""
    # At the wall clock's pace, eight sequences a batch as in the scenario suite, capacity
    # at full batches (`bench.rig.phased.paced`): "130%" is more than the engines can serve
    # (full batches, then a queue), which the report checks with their own running and
    # waiting counts per phase. (The first version ran 3x slower than the wall clock: 45
    # minutes a run, most of them in the replays and in calibrating six workloads by search.)
    base = paced(routing_config(), SUITE_MAX_BATCH)
    # The policy as a user would write it: objectives and what batch does when saturated,
    # shed with a 429 or queued in Envoy (16 batch requests in flight per Envoy, two per
    # replica, the rest waiting), and bounds beyond the default rule (mean engine TTFT at
    # half the interactive objective) for a pool whose engines run 8 sequences at most:
    # half a request waiting per replica (a chat turn that waits for a batch slot waits
    # about as long as a slot takes to free, most of a second here), read on the busiest
    # quarter of the replicas, where the sessions that bounded load lets pile up wait
    # first. A step is given back at 0.7 of the bounds, not 0.5: batch prompts' own first
    # tokens (0.5 s and more of prefill) raise the mean TTFT of a pool that has room.
    saturation: dict[str, Any] = {"queue": 0.5, "low": 0.7, "busiest": 25}
    interactive = {"name": INTERACTIVE, "objective": {"ttft": "1s"}}
    batch = {
        "name": BATCH,
        "match": {"headers": [{"name": BATCH_HEADER[0], "value": BATCH_HEADER[1]}]},
        "objective": {"ttft": "30s"},
    }
    service_classes = {
        "classes": {
            "saturation": saturation,
            "classes": [
                interactive,
                {**batch, "whenSaturated": "shed", "retryAfter": "30s"},
            ],
        },
        "classes_queue": {
            "saturation": saturation,
            "classes": [
                interactive,
                {**batch, "whenSaturated": "queue", "queue": {"concurrency": 16}},
            ],
        },
        "classes_mean": {
            "saturation": {key: value for key, value in saturation.items() if key != "busiest"},
            "classes": [
                interactive,
                {**batch, "whenSaturated": "shed", "retryAfter": "30s"},
            ],
        },
        "classes_queue_bound": {
            "saturation": {**saturation, "ttft": "2s"},
            "classes": [
                interactive,
                {**batch, "whenSaturated": "shed", "retryAfter": "30s"},
            ],
        },
    }
    # A batch lane: one replica of the eight serves batch and nothing else, the other seven
    # the sessions. A batch prompt's 2,048-token prefill chunk is an engine step of half a
    # second in which every other sequence of its replica waits, so interactive turns keep
    # their latency only where no batch prefills. The lane's own saturation decides what
    # batch is shed: no more than a batch's worth waiting (8), and a first token within half
    # the batch objective; interactive is never restricted, so the bounds are batch's.
    service_classes["classes_lane"] = {
        "saturation": {"queue": SUITE_MAX_BATCH, "ttft": "15s"},
        "classes": [interactive, {**batch, "whenSaturated": "shed", "retryAfter": "30s"}],
    }
    config = ClassesConfig(service_classes=service_classes, routing=base, lanes={"classes_lane": 1})
    if short:
        config = replace(
            config,
            replicas=4,
            phases=(
                Phase("ramp", 4.0, 0.4, 0.1, measured=False),
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


def lane_route(route: Mapping[str, Any]) -> dict[str, Any]:
    """The route of a batch lane: the batch requests, with `route`'s balancing fields, to the
    lane's pool; the policy lists it before the route of everything else."""
    header = {"name": BATCH_HEADER[0], "value": BATCH_HEADER[1]}
    return {
        **route,
        "name": BATCH,
        "match": {"pathPrefix": "/v1/", "headers": [header]},
        "tiers": [[LANE_POOL]],
    }


# --------------------------------------------------------------------------- workloads


def _shifted(sessions: tuple[Session, ...], offset: float, **changes: Any) -> list[Session]:
    return [replace(s, start=s.start + offset, **changes) for s in sessions]


def _at_rate(base: WorkloadConfig, rate: float) -> WorkloadConfig:
    if base.kind == "docs":
        return replace(base, doc_rate=rate)
    return replace(base, session_rate=rate)


@dataclass(frozen=True)
class PhaseRates:
    """The arrival rates of one phase."""

    interactive_session_rate: float
    batch_request_rate: float


@dataclass(frozen=True)
class ClassesCalibration:
    """The rates each phase's workloads were generated at, searched for on one phase (the
    peak) and scaled for the others; the report prints it as JSON (`to_json`)."""

    calibrated_on: str
    rates: dict[str, PhaseRates]
    """By phase name."""
    estimated_cache_blind_load: dict[str, float]
    """By class, at the peak."""

    def to_json(self) -> dict[str, Any]:
        """The phases' rates under their names, beside the other two."""
        return {
            "calibrated_on": self.calibrated_on,
            **{name: asdict(rates) for name, rates in self.rates.items()},
            "estimated_cache_blind_load": self.estimated_cache_blind_load,
        }


def build_workloads(config: ClassesConfig) -> tuple[Workload, Workload, ClassesCalibration]:
    """The interactive requests alone and interactive plus batch, phase by phase.

    Each class's arrival rate is searched for once, on the overload phase (the routing
    benchmark's calibration), and scaled for the other phases: the cache-blind load grows
    in proportion to the rate, and searching six workloads took longer than replaying them.
    """
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
    peak = max(config.phases, key=lambda phase: phase.interactive + phase.batch)
    _, chat_cal = calibrate(
        replace(routing, target_load=peak.interactive),
        replace(chat_base, duration=peak.duration),
    )
    _, docs_cal = calibrate(
        replace(routing, target_load=peak.batch, warm_system_prompts=False),
        replace(batch_base, duration=peak.duration),
    )
    chat_rate, doc_rate = chat_cal.rate, docs_cal.rate
    interactive: list[Session] = []
    batch: list[Session] = []
    rates_by_phase: dict[str, PhaseRates] = {}
    offset = 0.0
    for index, phase in enumerate(config.phases):
        rates = {
            INTERACTIVE: chat_rate * phase.interactive / peak.interactive,
            BATCH: doc_rate * phase.batch / peak.batch,
        }
        chat = generate(
            _at_rate(
                replace(chat_base, duration=phase.duration, seed=chat_base.seed + index),
                rates[INTERACTIVE],
            )
        )
        docs = generate(
            _at_rate(replace(batch_base, duration=phase.duration, seed=101 + index), rates[BATCH])
        )
        interactive += _shifted(chat.sessions, offset)
        batch += [
            replace(
                session,
                start=session.start + offset,
                extra_headers=(BATCH_HEADER, ("x-tenant-id", TENANTS[n % 3])),
            )
            for n, session in enumerate(docs.sessions)
        ]
        rates_by_phase[phase.name] = PhaseRates(rates[INTERACTIVE], rates[BATCH])
        offset += phase.duration
    calibration = ClassesCalibration(
        calibrated_on=peak.name,
        rates=rates_by_phase,
        estimated_cache_blind_load={
            INTERACTIVE: chat_cal.estimated_cache_blind_load,
            BATCH: docs_cal.estimated_cache_blind_load,
        },
    )
    alone = Workload(chat_base, tuple(sorted(interactive, key=lambda s: s.start)))
    mixed = Workload(chat_base, tuple(sorted(interactive + batch, key=lambda s: s.start)))
    return alone, mixed, calibration


def class_of(result: RequestResult) -> str:
    """Chat sessions are interactive; the document requests are the batch."""
    return BATCH if result.session.startswith("d") else INTERACTIVE
