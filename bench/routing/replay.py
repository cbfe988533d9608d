"""The scenario suite's replays: every fleet's load generator in a process of its own,
started warm and at the same instant, with a slowdown on the replay's own clock, while the
suite follows kvpilot's weights."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import time
from collections.abc import Sequence

import httpx

from bench.rig.loadgen import RunResult, replay
from bench.rig.stack import MODEL
from bench.rig.workload import Workload
from bench.routing.fleets import Fleet, admin, kvpilot_weights, say
from bench.routing.results import Timeline
from bench.routing.scenarios import Scenario, SlowEvent, SuiteConfig


async def slow_down(
    event: SlowEvent, replicas: Sequence[tuple[str, str]], started: float, scale: float
) -> None:
    """Slow one replica of a fleet from ``event.start`` to ``event.end`` (simulated seconds
    after the replay's ``started``, a ``time.monotonic()`` moment), and recover it."""
    url = replicas[event.replica][1]
    await asyncio.sleep(max(0.0, started + event.start * scale - time.monotonic()))
    await admin(url, "/admin/slow", {"factor": event.factor})
    try:
        await asyncio.sleep(max(0.0, started + event.end * scale - time.monotonic()))
    finally:
        await admin(url, "/admin/slow", {"factor": 1.0})


def replay_process(
    workload: Workload,
    url: str,
    replicas: list[tuple[str, str]],
    start_at: float,
    time_scale: float,
    deadline: float,
    event: SlowEvent | None,
    stop_at: float | None,
) -> RunResult:
    """One fleet's replay, in a process of its own, from the wall-clock moment `start_at`.

    A load generator is Python too: one process for every fleet would make it the
    bottleneck of all of them on a busy machine. One process per fleet, started at the same
    instant, keeps the fleets independent and the comparison fair.
    """

    async def run() -> RunResult:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        late = time.time() - start_at
        # The slowdown runs in the replay's own loop and on the replay's clock, so it falls
        # where the report's windows expect it.
        slowing: list[asyncio.Task[None]] = []

        def start_events(started: float) -> None:
            if event is not None:
                slowing.append(asyncio.create_task(slow_down(event, replicas, started, time_scale)))

        result = await replay(
            workload,
            url,
            model=MODEL,
            time_scale=time_scale,
            replicas=replicas,
            deadline=deadline,
            sample_interval=1.0,
            on_start=start_events,
            stop_at=stop_at,
        )
        result.late = late
        for task in slowing:
            task.cancel()
        await asyncio.gather(*slowing, return_exceptions=True)
        return result

    return asyncio.run(run())


def _ready(seconds: float) -> int:
    """A task that holds one worker for a moment: once one has run per worker, every worker
    process has started and imported the bench, including what httpx imports only when a
    client is first made (seconds on a loaded machine, which would delay the first requests
    behind the replay's schedule)."""

    async def client() -> None:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport()):
            pass

    asyncio.run(client())
    time.sleep(seconds)
    return os.getpid()


def start_workers(count: int) -> concurrent.futures.ProcessPoolExecutor:
    """The load generators' processes, started and warm before any replay: a process that
    is still importing when its replay should begin would start its fleet late."""
    pool = concurrent.futures.ProcessPoolExecutor(
        count, mp_context=multiprocessing.get_context("spawn")
    )
    pids = set(pool.map(_ready, [0.5] * count))
    while len(pids) < count:
        pids |= set(pool.map(_ready, [0.5] * count))
    return pool


def replay_all(
    pool: concurrent.futures.ProcessPoolExecutor,
    fleets: Sequence[Fleet],
    workload: Workload,
    scenario: Scenario,
    config: SuiteConfig,
    api_url: str,
) -> tuple[dict[str, RunResult], dict[str, Timeline]]:
    """Every fleet's replay at once; and, while they run, the weights kvpilot gives the
    replicas of each telemetry fleet (twice a second of wall time), to see when they move."""
    scale = config.sim.time_scale
    start_at = time.time() + 2.0
    futures = [
        pool.submit(
            replay_process,
            workload,
            fleet.url,
            [(r.id, r.url) for r in fleet.replicas],
            start_at,
            scale,
            config.deadline,
            scenario.event,
            # Without a ramp (the smoke run) every turn is sent: the fleets replay the same
            # requests, which the smoke test checks.
            scenario.workload.duration if config.ramp else None,
        )
        for fleet in fleets
    ]
    timelines: dict[str, Timeline] = {f.policy.key: [] for f in fleets if f.telemetry}
    while not all(future.done() for future in futures):
        for fleet in fleets:
            if fleet.telemetry:
                with contextlib.suppress(httpx.HTTPError):
                    weights = kvpilot_weights(api_url, fleet.pool)
                    at = (time.time() - start_at) / scale
                    timelines[fleet.policy.key].append(
                        (at, [weights.get(f"{r.host}:{r.port}", 0.0) for r in fleet.replicas])
                    )
        concurrent.futures.wait(futures, timeout=0.5)
    results = [future.result() for future in futures]
    for fleet, run in zip(fleets, results, strict=True):
        if run.late > 0.5:
            say(f"   warning: {fleet.policy.key}'s load generator started {run.late:.1f}s late")
    runs = {fleet.policy.key: run for fleet, run in zip(fleets, results, strict=True)}
    return runs, timelines
