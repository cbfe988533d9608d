"""The scenario suite's definitions: its scenarios, the policies it compares, its
configuration and the small helpers that both the runner (`bench.routing.suite`) and the report
(`bench.routing.report`) read. Plain data, no I/O beyond writing a JSON file."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.rig.routes import (
    PREFIX_HASH_CHARS,
    SESSION_AFFINITY,
    Policy,
    bounded_load,
    standard_policies,
)
from bench.rig.workload import CHAT, WorkloadConfig
from replicasim.simulator import SimConfig

SUITE_MAX_BATCH = 8
"""Sequences per engine step in the suite's replicas at its smallest batch size (vLLM's
``max_num_seqs``)."""

SUITE_BATCH_SIZES = (8, 32, 128)
"""The batch sizes `make bench` runs the suite at: the suite's first, vLLM's defaults for
small GPUs, and a large one."""


@dataclass(frozen=True)
class SlowEvent:
    """One replica's engine runs ``factor`` times slower from ``start`` to ``end`` (simulated
    seconds into the run)."""

    replica: int
    factor: float
    start: float
    end: float


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    workload: WorkloadConfig
    load: float = 0.75
    """Offered load, as a share of the fleet's estimated cache-blind capacity."""
    slow: tuple[float, ...] = ()
    """Per replica (by index), how many times slower its engine steps run; missing = 1."""
    kv: tuple[float, ...] = ()
    """Per replica, its share of the standard KV cache; missing = 1."""
    event: SlowEvent | None = None

    def slow_of(self, index: int) -> float:
        return self.slow[index] if index < len(self.slow) else 1.0

    def kv_of(self, index: int) -> float:
        return self.kv[index] if index < len(self.kv) else 1.0

    def capacity(self, replicas: int) -> float:
        """The fleet's speed in standard replicas (a half-speed replica counts 0.5)."""
        return sum(1.0 / self.slow_of(i) for i in range(replicas))


AFFINITY = {**SESSION_AFFINITY, "prefixHashChars": PREFIX_HASH_CHARS}
"""Session affinity, and prompt-prefix affinity for requests without a session (documents)."""

RECOMMENDED = "kvpilot"
"""The README's recommended LLM route: the policy the targets are checked on."""

_STANDARD = standard_policies(AFFINITY)
_RECOMMENDED_AFFINITY = {
    key: value for key, value in AFFINITY.items() if key != "hashBalanceFactor"
}


def _recommended_with(key: str, title: str, default: bool = False, **affinity: Any) -> Policy:
    """The recommended route with `affinity` fields changed, run only when named (or
    `default`). A route given its own calm bound keeps it: its bound does not follow the
    batch capacity."""
    if "hashBalanceFactor" in affinity:
        affinity = {"capacityBound": False, **affinity}
    return Policy(
        key,
        title,
        {"balancing": "telemetry", "sessionAffinity": {**_RECOMMENDED_AFFINITY, **affinity}},
        default=default,
    )


ORACLE = "capacity_oracle"
"""Affinity alone with static endpoint weights equal to the replicas' true speeds (1 / the
scenario's slow factor, ``bench.routing.fleets.pool_body``): the reference for capacity
weights learned from telemetry."""


SUITE_POLICIES: tuple[Policy, ...] = (
    _STANDARD["round_robin"],
    _STANDARD["affinity"],
    # An A/A control: the same policy again, on its own replicas. Its distance from
    # "affinity" is what noise alone does within one run, so every report shows it.
    replace(
        _STANDARD["affinity"],
        key="affinity_copy",
        title="affinity + bounded load (second copy, A/A)",
        default=False,
    ),
    # A consistent hash and nothing else (vllm-router's session routing): no bounded load, no
    # telemetry. What any bound has to beat in calm traffic.
    replace(
        bounded_load(_STANDARD["affinity"], 0, "chash", "consistent hash, no bound"),
        default=True,
    ),
    # The same again on its own replicas (A/A): how far two fleets making the same decisions
    # land apart in one run, the control of "at most 1.0x a consistent hash".
    replace(
        bounded_load(
            _STANDARD["affinity"], 0, "chash_copy", "consistent hash, no bound (second copy, A/A)"
        ),
        default=False,
    ),
    # The capacity-weight oracle: affinity alone whose ring shares are the true speeds. Run
    # where replicas differ in speed only: elsewhere it is affinity alone.
    replace(
        _STANDARD["affinity"],
        key=ORACLE,
        title="capacity-weight oracle (affinity, static weights = true speeds)",
        weights_by_speed=True,
        scenarios=("hetero", "slowdown"),
    ),
    # The README's recommended route, with its fields and nothing else: telemetry balancing
    # and session affinity at kvpilot's defaults for it (bounded load 125%, 100% while
    # saturated), plus the prompt-prefix hashing the documents of the mix scenario need.
    # With `capacityBound` (the default on such a route, written out here): the bounded load
    # follows the replicas' batch capacity. The route with `capacityBound: false` (two fixed
    # bounds) is `kvpilot_twin` beside it.
    Policy(
        RECOMMENDED,
        "kvpilot: affinity + telemetry, capacityBound",
        {
            "balancing": "telemetry",
            "sessionAffinity": {**_RECOMMENDED_AFFINITY, "capacityBound": True},
        },
    ),
    # The recommended route with `hashBalanceFactor: 450`: the same ladder (450% is one of its
    # rungs), holding 450% rather than 125% before any record knows the batch size. It
    # measured the 450% rung before the ladder had it (docs/bounded-load.md); run only when
    # named.
    Policy(
        "kvpilot_450",
        "kvpilot: capacityBound, 450% before the batch size is known",
        {
            "balancing": "telemetry",
            "sessionAffinity": {
                **_RECOMMENDED_AFFINITY,
                "capacityBound": True,
                "hashBalanceFactor": 450,
            },
        },
        default=False,
    ),
    # The recommended route with `hashBalanceFactor: 300`: the same rungs, holding 300% rather
    # than 125% before any record knows the batch size (the first record then takes the
    # loosest bound that fits, as on the recommended route). It measured a looser start
    # before the first record's rule (docs/bounded-load.md); run only when named.
    Policy(
        "kvpilot_start300",
        "kvpilot: capacityBound, 300% before the batch size is known",
        {
            "balancing": "telemetry",
            "sessionAffinity": {
                **_RECOMMENDED_AFFINITY,
                "capacityBound": True,
                "hashBalanceFactor": 300,
            },
        },
        default=False,
    ),
    # The recommended route with `capacityBound: false`: two fixed bounds, 125% and 100% while
    # saturated. What the capacity bound refines, so it runs by default.
    _recommended_with(
        "kvpilot_twin",
        "kvpilot, fixed bounds (125%, 100% when saturated)",
        default=True,
        capacityBound=False,
    ),
    # The recommended route before its bounded-load default: capacity weights alone.
    replace(
        bounded_load(
            _STANDARD["affinity_telemetry"], 150, "kvpilot_b150", "kvpilot, bounded load 1.50"
        ),
        route={
            "balancing": "telemetry",
            "sessionAffinity": {**AFFINITY, "hashBalanceFactor": 150, "capacityBound": False},
        },
    ),
    # The recommended route with one bounded load whatever the load: 125%, the calm bound,
    # without the tighter one for saturated replicas. What the saturated bound is measured
    # against.
    _recommended_with(
        "kvpilot_static",
        "kvpilot, one bound (125%, none tighter when saturated)",
        saturatedHashBalanceFactor=0,
        capacityBound=False,
    ),
    # The recommended route with popular prompt prefixes spread over replicas
    # (`hotPrefixShare` at about one replica's even share of eight). What a hot document
    # held on one replica at its bounded load is measured against.
    _recommended_with(
        "kvpilot_spread", "kvpilot, hot prompt prefixes spread (13%)", hotPrefixShare=13
    ),
    # The recommended route on Maglev rather than a ring. Envoy's weighted ring keeps about
    # `minimum_ring_size` points in all, so a weight cut on one host gives every other host
    # more points, which take sessions from one untouched replica to another; this measures
    # whether Maglev's table moves fewer.
    _recommended_with("kvpilot_maglev", "kvpilot on Maglev", algorithm="maglev"),
    # The recommended route with another calm bound (the saturated one unchanged): looser,
    # towards affinity alone's 150% and its turns moved; tighter, towards an even load.
    *(
        _recommended_with(
            f"kvpilot_c{factor}", f"kvpilot, calm bound {factor}%", hashBalanceFactor=factor
        )
        for factor in (100, 110, 135, 150)
    ),
    replace(_STANDARD["least_request"], default=False),
    replace(_STANDARD["orca"], default=False),
)


def _chat(**overrides: Any) -> WorkloadConfig:
    return replace(CHAT, **overrides)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("chat", "homogeneous chat at 75%", _chat()),
    Scenario(
        "mix",
        "chat + shared documents (Zipf popularity) at 75%",
        _chat(
            kind="mix",
            session_rate=1.0,
            doc_rate=1.5,
            documents=(2000, 3000, 4000, 5000, 2500, 3500, 4500, 6000),
            doc_popularity=1.0,
        ),
    ),
    Scenario("overload", "chat at 110% (overload)", _chat(), load=1.10),
    Scenario(
        "hetero",
        "heterogeneous: 2 replicas at half speed, 1 with half the KV cache",
        _chat(),
        slow=(2.0, 2.0),
        kv=(1.0, 1.0, 0.5),
    ),
    # Longer than the others: sessions arrive before, during and after the slow period, so
    # the report sees the slowed replica's share of new sessions fall and come back.
    Scenario(
        "slowdown",
        "one replica 3x slower from 35 s to 55 s, then recovered",
        _chat(duration=90.0),
        event=SlowEvent(replica=0, factor=3.0, start=35.0, end=55.0),
    ),
    Scenario("bursty", "chat at 75%, bursty arrivals", _chat(arrival="bursty")),
)


@dataclass(frozen=True)
class SuiteConfig:
    replicas: int = 8
    sim: SimConfig = field(default_factory=SimConfig)
    """The replicas at batch size ``SUITE_MAX_BATCH``; every other batch size's from it
    (``sim_at``)."""
    batch_sizes: tuple[int, ...] = (SUITE_MAX_BATCH,)
    """The replicas' batch sizes (vLLM ``max_num_seqs``) the suite runs at, one after the
    other, each with its own fleets; the load is the scenario's share of round robin's
    capacity at that size."""
    scenarios: tuple[Scenario, ...] = SCENARIOS
    policies: tuple[str, ...] = tuple(p.key for p in SUITE_POLICIES if p.default)
    seeds: tuple[int, ...] = (1, 2, 3)
    slo_ttft: float = 1.0
    """Goodput counts requests whose first token came within this many simulated seconds."""
    agent_interval: float = 1.0
    """Simulated seconds between the telemetry agent's scrapes."""
    deadline: float = 300.0
    """Wall-clock limit of one run (all policies at once)."""
    ramp: float = 25.0
    """Simulated seconds of ramp-up, not measured: sessions last about half a minute, so
    only after that does the fleet carry its steady share of old and new conversations.
    Sessions send no turn after the workload's ``duration`` (the load stays steady to the
    end), so every number is of requests started from ``ramp`` to ``duration``."""
    out_dir: Path = Path("bench/results")


SUITE_TIME_SCALE = 0.6
"""Wall-clock seconds per simulated second: engine steps of 10 ms and more in wall time, so
several fleets of simulated engines keep their schedule on a shared 2-core machine."""


SUITE_SCENARIOS = ("chat", "mix", "overload", "hetero")
"""The scenarios `make bench` runs at every batch size (the others run when named)."""
SUITE_DURATION = 40.0
"""Simulated seconds of session arrivals in `make bench`'s scenarios."""
SUITE_RAMP = 15.0
"""Simulated seconds of those not measured."""


def sim_at(base: SimConfig, batch: int) -> SimConfig:
    """`base` (the replicas at ``SUITE_MAX_BATCH``) with batches of `batch` sequences: the KV
    cache grows with the batch (the same cache per sequence, so the cache pressure of a
    scenario is the same at every size), and the wall clock runs slower by the square root
    of the batch's growth (a fleet with 16 times the sequences in flight offers its load
    generator 4 times the requests a simulated second, so at 4 times the wall time per
    simulated second it sends about as many a wall second as at 8), and the streams send
    their chunks that much less often."""
    grow = batch / SUITE_MAX_BATCH
    return replace(
        base,
        max_batch=batch,
        kv_blocks=max(1, round(base.kv_blocks * grow)),
        time_scale=round(base.time_scale * grow**0.5, 6),
        # One chunk per interval per stream: with 16 times the streams, 16 times the
        # interval keeps the chunks a wall second as few (the suite reads the engines' times).
        stream_interval=base.stream_interval * max(1.0, grow),
    )


def batch_key(scenario: str, batch: int) -> str:
    """A scenario's key at one batch size, as the results name it: ``chat@32``."""
    return f"{scenario}@{batch}"


def split_key(key: str) -> tuple[str, int | None]:
    """(scenario, batch size) of a results key; no batch size for a key without one."""
    scenario, _, batch = key.partition("@")
    return scenario, int(batch) if batch else None


def default_suite(short: bool = False) -> SuiteConfig:
    """`make bench`'s suite, or with `short` a smoke run: one seed of a short heterogeneous
    scenario on 4 replicas per policy."""
    from bench.routing.sequential import default_config

    # One chunk per second of wall time per stream is enough for the suite's numbers (the
    # first token and the end are sent at once) and keeps the CPU of several fleets low.
    # Eight sequences a batch: a fleet reaches its capacity (full batches, then a queue)
    # with a few dozen conversations in flight, which one load generator per fleet can
    # offer on time; with 32, the engines idled at a "75%" that the clients could not send.
    sim = replace(
        default_config().sim,
        max_batch=SUITE_MAX_BATCH,
        stream_interval=1.0,
        time_scale=SUITE_TIME_SCALE,
    )
    if not short:
        # Scaled down from 80 s of sessions (25 s not measured) so that three batch sizes of
        # the four scenarios the targets name fit a shared 2-core machine's hour.
        scenarios = tuple(
            replace(s, workload=replace(s.workload, duration=SUITE_DURATION))
            for s in SCENARIOS
            if s.key in SUITE_SCENARIOS
        )
        return SuiteConfig(
            sim=sim, batch_sizes=SUITE_BATCH_SIZES, scenarios=scenarios, ramp=SUITE_RAMP
        )
    scenarios = tuple(
        replace(
            s,
            workload=replace(
                s.workload, duration=6.0, max_turns=3, think_mean=1.0, answer_median=60
            ),
        )
        for s in SCENARIOS
        if s.key == "hetero"
    )
    # Three fleets: a fourth on a loaded test machine made the bounded run miss its deadline,
    # and the smoke run checks the report's shape, not noise. The oracle is affinity alone
    # with static weights, so it checks both.
    policies = ("round_robin", ORACLE, RECOMMENDED)
    return SuiteConfig(
        replicas=4,
        sim=sim,
        scenarios=scenarios,
        policies=policies,
        seeds=(1,),
        deadline=90.0,
        ramp=0.0,
    )


def median_spread(values: Sequence[float | None]) -> tuple[float, float, float] | None:
    """(median, min, max) of the values that exist; None when none do."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return statistics.median(present), min(present), max(present)


def config_dict(config: SuiteConfig) -> dict[str, Any]:
    return {
        "replicas": config.replicas,
        "sim": asdict(config.sim),
        "batch_sizes": list(config.batch_sizes),
        "seeds": list(config.seeds),
        "slo_ttft": config.slo_ttft,
        "agent_interval": config.agent_interval,
        "scenarios": [asdict(s) for s in config.scenarios],
        "policies": list(config.policies),
    }


def _json_default(value: Any) -> Any:
    return str(value)


def dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=_json_default))
