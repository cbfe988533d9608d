"""The control-plane benchmark's scale section: telemetry at 10,000 endpoints.

Simulated agents scrape every endpoint each second and write to etcd as `kvpilot agent` decides
(the write band, ``--refresh``), with kvpilot serving; reported are the etcd writes, kvpilot's
CPU and the snapshot pushes telemetry causes. The comparison with an older commit is in
``bench.controlplane.baseline``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from bench.rig.probe import cpu_seconds
from bench.rig.report import table
from controlplane.agent.scrape import AgentConfig
from controlplane.etcd import EtcdClient, EtcdError
from controlplane.etcd.store import Store
from signals.telemetry import TelemetryRecord

# -- telemetry at scale ----------------------------------------------------------------------


@dataclass
class _Replica:
    """One simulated backend's load: a level it hovers around, and what its agent wrote."""

    pool: str
    endpoint_id: str
    level: float
    written: TelemetryRecord | None = None
    exact: TelemetryRecord | None = None
    """What an agent writing on any change (the baseline rule) would have written last."""
    written_round: int = 0
    exact_round: int = 0
    """Rounds (simulated seconds) of those writes: the refresh counts in simulated time, so a
    round that takes longer than a second to simulate does not turn into refresh writes."""


def _record(replica: _Replica, rng: random.Random, now: float) -> TelemetryRecord:
    """A scrape: the replica's level with a few percent of noise on every signal."""
    level = replica.level

    def noisy(value: float) -> float:
        return max(0.0, round(value * rng.uniform(0.96, 1.04), 3))

    # Valid by construction; validating 10,000 records a second would be the simulator's cost.
    return TelemetryRecord.model_construct(
        at=now,
        prefix_hit_rate=None,
        waiting=round(noisy(level * 40)),
        running=round(noisy(8 + level * 24)),
        max_running=32,
        kv_cache=min(1.0, noisy(0.2 + 0.6 * level)),
        pending_tokens=noisy(level * 20_000),
        format="vllm",
    )


async def telemetry_at_scale(
    etcd_endpoint: str,
    prefix: str,
    endpoints: list[tuple[str, str]],
    kvpilot_pid: int,
    metrics_url: str,
    *,
    seconds: float,
    shift: float = 0.01,
    seed: int = 1,
) -> TelemetryAtScale:
    """`endpoints` (pool, endpoint id) scraped every second for `seconds`, their agents'
    writes made to etcd as the agent decides them (``WriteBand``, ``--refresh``).

    Every second each replica's signals wiggle by a few percent and `shift` of the replicas
    move to a new load level. Reported: etcd writes per second under the agent's rule, and
    what the baseline rule (write on any change, refresh 3 s) would have written; kvpilot's
    CPU (user + system time of the daemon over the run, in cores); and fleet snapshot pushes
    caused by telemetry per second, also per 1,000 endpoints."""
    rng = random.Random(seed)
    agent = AgentConfig([], [])
    replicas = [_Replica(pool, endpoint_id, rng.random()) for pool, endpoint_id in endpoints]
    writes = exact_writes = failed = 0
    async with EtcdClient([etcd_endpoint]) as client:
        store = Store(client, prefix)
        # One lease for all, as an agent holds one for its backends.
        lease = await client.grant_lease(int(seconds) + 60)
        gate = asyncio.Semaphore(32)

        async def write(batch: list[tuple[_Replica, TelemetryRecord]]) -> None:
            nonlocal failed
            async with gate:
                try:
                    await store.put_telemetry_many(
                        [(r.pool, r.endpoint_id, json.loads(t.to_json())) for r, t in batch],
                        lease=lease,
                    )
                except EtcdError:
                    failed += len(batch)

        # Every agent's first round writes everything: before the measurement.
        now = time.time()
        first = []
        for replica in replicas:
            replica.written = replica.exact = _record(replica, rng, now)
            first.append((replica, replica.written))
        await asyncio.gather(
            *(write(first[i : i + AGENT_BACKENDS]) for i in range(0, len(first), AGENT_BACKENDS))
        )
        await asyncio.sleep(2 * agent.interval)
        pushes_before = await _telemetry_pushes(metrics_url)
        cpu_before = cpu_seconds(kvpilot_pid)
        started = time.monotonic()
        tick = 1
        while time.monotonic() - started < seconds:
            tick_started = time.monotonic()
            now = time.time()
            batch = []
            for replica in replicas:
                if rng.random() < shift:
                    replica.level = rng.random()
                record = _record(replica, rng, now)
                last = replica.written
                if (
                    last is None
                    or agent.band.moved(last, record)
                    or tick - replica.written_round >= agent.refresh
                ):
                    replica.written, replica.written_round = record, tick
                    batch.append((replica, record))
                exact = replica.exact
                if (
                    exact is None
                    or _signals(exact) != _signals(record)
                    or tick - replica.exact_round >= BASELINE_REFRESH
                ):
                    replica.exact, replica.exact_round = record, tick
                    exact_writes += 1
            writes += len(batch)
            # One agent per AGENT_BACKENDS replicas, each writing its round in one batch.
            await asyncio.gather(
                *(
                    write(batch[i : i + AGENT_BACKENDS])
                    for i in range(0, len(batch), AGENT_BACKENDS)
                )
            )
            tick += 1
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick_started)))
        elapsed = time.monotonic() - started
        cpu = cpu_seconds(kvpilot_pid) - cpu_before
        pushes = await _telemetry_pushes(metrics_url) - pushes_before
    # A round stands for one second of the agents' world. On a loaded machine a round can take
    # longer than a second to simulate; rates per round are then the conservative reading
    # (kvpilot had more than a second for each round's writes and may have rebuilt more often).
    tick -= 1
    per_round = max(tick, 1)
    return TelemetryAtScale(
        endpoints=len(replicas),
        seconds=round(elapsed, 1),
        rounds=tick,
        etcd_writes_per_s=round(writes / per_round),
        etcd_txns_per_s=round(-(-writes // AGENT_BACKENDS) / per_round),
        baseline_rule_writes_per_s=round(exact_writes / per_round),
        failed_writes=failed,
        kvpilot_cpu_cores=round(cpu / elapsed, 2),
        kvpilot_cpu_s_per_round=round(cpu / per_round, 2),
        telemetry_pushes_per_s=round(pushes / elapsed, 2),
        pushes_per_s_per_1000_endpoints=round(pushes / elapsed * 1000 / len(replicas), 3),
    )


@dataclass(frozen=True)
class TelemetryAtScale:
    """`telemetry_at_scale`'s numbers: rates per simulated second (a round)."""

    endpoints: int
    seconds: float
    rounds: int
    etcd_writes_per_s: int
    """Under the agent's write band."""
    etcd_txns_per_s: int
    """One transaction per agent of `AGENT_BACKENDS` backends."""
    baseline_rule_writes_per_s: int
    """What writing on any change, with a 3 s refresh, would have made."""
    failed_writes: int
    kvpilot_cpu_cores: float
    kvpilot_cpu_s_per_round: float
    telemetry_pushes_per_s: float
    pushes_per_s_per_1000_endpoints: float


def _signals(record: TelemetryRecord) -> tuple[float | None, ...]:
    return (record.waiting, record.running, record.kv_cache, record.pending_tokens)


AGENT_BACKENDS = 8
"""Backends per simulated agent (one agent per 8-GPU node): each agent writes its round's
records in one transaction."""
BASELINE_REFRESH = 3.0
"""The agent's refresh before the write band: an unchanged record every 3 s."""


async def _telemetry_pushes(metrics_url: str) -> float:
    """kvpilot's count of fleet snapshots pushed because of telemetry."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(metrics_url)).text
    for line in text.splitlines():
        if line.startswith('kvpilot_snapshot_pushes_total{cause="telemetry"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def telemetry_markdown(results: TelemetryAtScale) -> str:
    r = results
    rows = (
        ("etcd writes/s, agent's write band", r.etcd_writes_per_s),
        (
            "etcd writes/s the baseline rule would make (any change, 3 s refresh)",
            r.baseline_rule_writes_per_s,
        ),
        (
            f"etcd transactions/s (one per agent of {AGENT_BACKENDS} backends)",
            r.etcd_txns_per_s,
        ),
        ("kvpilot CPU, cores (over the run)", r.kvpilot_cpu_cores),
        ("kvpilot CPU seconds per simulated second", r.kvpilot_cpu_s_per_round),
        ("snapshot pushes/s caused by telemetry", r.telemetry_pushes_per_s),
        ("per 1,000 endpoints", r.pushes_per_s_per_1000_endpoints),
    )
    return "\n".join(
        [
            f"Telemetry at scale: {r.endpoints} endpoints scraped every second, "
            f"{r.rounds} rounds in {r.seconds} s (simulated agents writing to etcd, "
            "kvpilot serving; rates per simulated second):",
            "",
            *table(("measure", "value"), rows, "lr"),
            "",
        ]
    )
