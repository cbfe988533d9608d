"""Run the regions benchmark: per policy (locality-blind, locality-aware by batch fill alone,
locality-aware with feed-forward, and when named each region behind a gate) a fresh rig and
the same phases, every request recorded; then the report.

Phases, one after another (region A is the first region, B the second):

1. steady: each region's own load at ``steady_load`` of its capacity;
2. overload: region A at ``overload``, B steady;
3. region down: both steady; a quarter in, every replica of region A is killed (SIGKILL);
4. recovery: region A's replicas start again; both steady;
5. spot wave: both at ``wave_load``; after a calm stretch the spot replicas (3 of 8) get a
   preemption notice (their agents' notice file appears), and ``notice`` seconds later they
   die.

A region's capacity, in requests per second, is its replicas' batch slots over the mean time
of one request served alone in its own region (measured first, around the rig's Envoys).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.regions.config import RegionsConfig
from bench.regions.load import CLIENT_REGION_HEADER, OpenLoop, Sent
from bench.regions.marks import Marks
from bench.regions.stack import MODEL, RegionsStack, say, start_regions


async def measure_service_time(stack: RegionsStack, rounds: int = 2) -> float:
    """Mean seconds of one request in a full batch (``max_batch`` at once on one replica of
    each region, from its own region): a region's capacity is its slots over this."""
    config = stack.config
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["w"] * config.prompt_words)}],
        "max_tokens": config.max_tokens,
        "stream": True,
    }
    times: list[float] = []

    async def one(client: httpx.AsyncClient, url: str, region: str) -> None:
        started = time.monotonic()
        async with client.stream(
            "POST", url, json=body, headers={CLIENT_REGION_HEADER: region}
        ) as response:
            async for _ in response.aiter_lines():
                pass
        times.append(time.monotonic() - started)

    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(rounds):
            await asyncio.gather(
                *(
                    one(client, f"{backend.replicas[0].url}/v1/chat/completions", region)
                    for region, backend in stack.backends.items()
                    for _ in range(config.sim.max_batch)
                )
            )
    return statistics.fmean(times)


async def _watch_drains(
    stack: RegionsStack, load: OpenLoop, marks: Marks, stop: asyncio.Event
) -> None:
    spot = {f"{r.host}:{r.port}": r.id for b in stack.backends.values() for r in b.replicas}
    spot = {key: rid for key, rid in spot.items() if rid in stack.spot_ids()}
    urls = [f"{stack.kvpilot.api_url}/v1/pools/{pool}/endpoints" for pool in stack.pools]
    headers = {"authorization": f"Bearer {stack.token}"}
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            items = []
            for url in urls:
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    items += (await client.get(url, headers=headers)).json()["items"]
            for item in items:
                rid = spot.get(item["id"])
                if rid and item["endpoint"].get("health") == "draining":
                    marks.learned.setdefault(rid, load.now())
            await asyncio.sleep(0.1)


ENVOY_STATS = (
    "downstream_rq_total|downstream_rq_active|upstream_rq_total|upstream_rq_active"
    "|upstream_rq_pending|upstream_cx_overflow|upstream_rq_retry|circuit_breakers"
    "|upstream_cx_total|upstream_cx_active|upstream_rq_completed"
)
"""The Envoy counters and gauges the run records at each phase's edges (``Marks.envoy_stats``)."""


async def _envoy_stats(stack: RegionsStack) -> dict[str, dict[str, int]]:
    """Region -> its Envoy's request counters (``ENVOY_STATS``), kvpilot's xDS and signals
    clusters left out."""
    out: dict[str, dict[str, int]] = {}
    async with httpx.AsyncClient(timeout=5) as client:
        for region, envoy in stack.envoys.items():
            try:
                response = await client.get(
                    f"{envoy.admin_url}/stats", params={"format": "json", "filter": ENVOY_STATS}
                )
                stats = response.json().get("stats", [])
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            out[region] = {
                str(s["name"]): int(s["value"])
                for s in stats
                if isinstance(s, dict) and "value" in s and "xds" not in str(s.get("name"))
            }
    return out


async def _snapshot(
    stack: RegionsStack, load: OpenLoop, marks: Marks, phase: str, edge: str
) -> None:
    sent: dict[str, int] = {}
    for record in load.records:
        sent[record.fleet] = sent.get(record.fleet, 0) + 1
    t = round(load.now(), 2)
    stats = await _envoy_stats(stack)
    marks.envoy_stats.append({"t": t, "phase": phase, "edge": edge, "sent": sent, "stats": stats})


SPILL_POLL = 0.5
"""Seconds between two reads of kvpilot's spill decisions (``/v1/status``)."""


async def _watch_spill(
    stack: RegionsStack, load: OpenLoop, marks: Marks, stop: asyncio.Event
) -> None:
    """Record each spill decision as it changes, with its inputs (``Marks.decisions``)."""
    url = f"{stack.kvpilot.api_url}/v1/status"
    headers = {"authorization": f"Bearer {stack.token}"}
    last: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            try:
                entries = (await client.get(url, headers=headers)).json().get("spill", [])
            except (httpx.HTTPError, ValueError, AttributeError):
                entries = []
            for entry in entries if isinstance(entries, list) else []:
                key = str(entry.get("fleetRoute"))
                if last.get(key) != entry:
                    last[key] = entry
                    marks.decisions.append({"t": round(load.now(), 2), **entry})
            await asyncio.sleep(SPILL_POLL)


async def _phases(stack: RegionsStack, load: OpenLoop, marks: Marks) -> None:
    config = stack.config
    a, b = config.regions
    rate = marks.capacity

    def rates(ra: float, rb: float) -> None:
        load.rates[a], load.rates[b] = ra * rate, rb * rate

    async def phase(name: str, seconds: float) -> float:
        start = load.now()
        say(f"  {name}: {seconds:g}s")
        await _snapshot(stack, load, marks, name, "start")
        await asyncio.sleep(seconds)
        marks.phases[name] = (start, load.now())
        await _snapshot(stack, load, marks, name, "end")
        return start

    rates(config.steady_load, config.steady_load)
    await phase("steady", config.phase)
    rates(config.overload, config.steady_load)
    await phase("overload", config.overload_phase)
    rates(config.steady_load, config.steady_load)
    start = load.now()
    say(f"  down: {config.phase:g}s, region {a} killed after {config.phase / 4:g}s")
    await asyncio.sleep(config.phase / 4)
    marks.killed = load.now()
    stack.backends[a].kill()
    await asyncio.sleep(config.phase * 3 / 4)
    marks.phases["down"] = (start, load.now())
    await asyncio.to_thread(stack.backends[a].start)
    marks.restarted = load.now()
    await phase("recovery", config.recovery)
    rates(0, 0)
    await asyncio.sleep(5)
    rates(config.wave_load, config.wave_load)
    start = load.now()
    calm = max(10.0, config.phase / 2)
    say(f"  wave: {calm:g}s calm, notice, {config.notice:g}s, spot replicas gone, 10s")
    await asyncio.sleep(calm)
    marks.notice = load.now()
    for path in stack.notice_files.values():
        path.write_text("terminate: spot capacity reclaimed\n")
    await asyncio.sleep(config.notice)
    marks.gone = load.now()
    for rid in stack.spot_ids():
        region = rid.rsplit("-", 1)[0]
        try:
            await asyncio.to_thread(stack.backends[region].die, rid)
        except Exception as error:
            say(f"  {rid}: {error}")
    await asyncio.sleep(10)
    marks.phases["wave"] = (start, load.now())


async def _drive(stack: RegionsStack, marks: Marks) -> list[Sent]:
    load = OpenLoop(
        {region: stack.url(region) for region in stack.config.regions},
        model=MODEL,
        prompt_words=stack.config.prompt_words,
        max_tokens=stack.config.max_tokens,
        seed=stack.config.seed,
    )
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run())
    watcher = asyncio.create_task(_watch_drains(stack, load, marks, stop))
    spill = asyncio.create_task(_watch_spill(stack, load, marks, stop))
    try:
        await _phases(stack, load, marks)
    finally:
        load.stop()
        stop.set()
        await asyncio.gather(runner, watcher, spill, return_exceptions=True)
    return load.records


def run_policy(config: RegionsConfig, policy: str, state_dir: Path) -> tuple[Marks, list[Sent]]:
    """One policy's run on a fresh rig."""
    say(f"policy {policy}: starting the rig")
    signal = "fill" if policy == "fill" else "arrivals"
    with start_regions(
        config,
        state_dir / policy,
        aware=policy not in ("blind", "gate"),
        signal=signal,
        gate=policy == "gate",
    ) as stack:
        marks = Marks()
        marks.service = asyncio.run(measure_service_time(stack))
        marks.capacity = config.replicas * config.sim.max_batch / marks.service
        say(
            f"  one request in a full batch: {marks.service * 1000:.0f} ms; a region serves "
            f"{marks.capacity:.1f} req/s at full batches"
        )
        records = asyncio.run(_drive(stack, marks))
    return marks, records


def run_regions_bench(config: RegionsConfig, *, state_dir: Path) -> Path:
    """Every policy, then the report; returns the report's path."""
    from bench.regions.report import summarize, write_report

    runs: dict[str, tuple[Marks, list[Sent]]] = {}
    for policy in config.policies:
        runs[policy] = run_policy(config, policy, state_dir)
    summary = {
        policy: summarize(config, marks, records) for policy, (marks, records) in runs.items()
    }
    config.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    requests: dict[str, list[dict[str, Any]]] = {
        policy: [r.to_json() for r in records] for policy, (_, records) in runs.items()
    }
    (config.out_dir / f"regions-{stamp}.requests.json").write_text(json.dumps(requests))
    # Each spill decision with its inputs, per policy, with the phases to read them against.
    decisions = {
        policy: {
            "phases": marks.phases,
            "notice": marks.notice,
            "gone": marks.gone,
            "decisions": marks.decisions,
            "envoyStats": marks.envoy_stats,
        }
        for policy, (marks, _) in runs.items()
    }
    (config.out_dir / f"regions-{stamp}.decisions.json").write_text(json.dumps(decisions, indent=1))
    return write_report(config, summary, config.out_dir / f"regions-{stamp}.md")


__all__ = ["Marks", "run_policy", "run_regions_bench"]
