"""The floor of the spot wave's tail under any share-based spill, from a run's files.

``python -m bench.regions.floor DIR [DIR ...]`` (each DIR holds one ``python -m bench regions``
run's ``regions-*.json``, ``.requests.json`` and ``.decisions.json``)

Envoy's priority spill splits a fleet's requests by share: each request of region A's fleet
crosses with the chance the overprovisioning factor sets. In the wave, a request of fleet A
either stays, and waits for one of the slots A's replicas have left when they are full, or
crosses, and pays the round trip on top of the TTFT of a request served at once. For every
share c of fleet A's requests sent across (0 to 1 by 0.02) this counts the share of the
wave's requests whose TTFT passes ``LIMIT`` times the p99 before the notice: c of fleet A's
at the chance that a TTFT at once (the wave's requests that stayed in their region and took
under ``AT_ONCE`` seconds) plus the round trip passes it, (1 - c) of them at the chance that a
TTFT at once plus the wait in one first-come queue of A's slots left, at A's kept load, with
the run's deterministic service time (simulated), passes it. A's slots pooled, region B
never queueing and an exact share all favour the spill: the least of these over c is a
floor, and where it is over 1% no share-based spill meets the p99 target.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.regions.config import RegionsConfig

LIMIT = 1.5
"""The target: the TTFT p99 during the wave at most this times the p99 before it."""
AT_ONCE = 0.2
"""Seconds under which a request that stayed in its region is taken as served at once."""
ARRIVALS = 40_000
"""Arrivals simulated per kept load (the first tenth is left out as warm-up)."""


@dataclass(frozen=True)
class Floor:
    """One run's floor: the least share of the wave's requests over the limit, where."""

    limit_s: float
    load: float
    """Fleet A's arrivals over its replicas' capacity left (slots over the service time)."""
    share_a: float
    """Fleet A's share of the wave's requests."""
    cross_over: float
    """Chance a crossing request passes the limit."""
    least_over: float
    at_cross: float
    """The share of fleet A sent across at which the least is reached."""


def queue_waits(
    load: float, slots: int, service: float, seed: int = 7, arrivals: int = ARRIVALS
) -> list[float]:
    """Waits for a slot in one first-come queue of `slots` at `load`, with Poisson arrivals
    (`arrivals` of them) and a deterministic `service` time."""
    rng = random.Random(seed)
    rate = load * slots / service
    free = [0.0] * slots
    now, out = 0.0, []
    for index in range(arrivals):
        now += rng.expovariate(rate)
        start = max(now, heapq.heappop(free))
        heapq.heappush(free, start + service)
        if index > arrivals // 10:
            out.append(start - now)
    return out


def floor(run: Path, config: RegionsConfig | None = None, arrivals: int = ARRIVALS) -> Floor:
    """The floor of the run in directory `run` (its ``aware`` policy), each kept load
    simulated over `arrivals`."""
    config = config or RegionsConfig()
    a = config.regions[0]
    report = _one(run, "regions-*[0-9].json")["aware"]
    marks = _one(run, "regions-*.decisions.json")["aware"]
    records = _one(run, "regions-*.requests.json")["aware"]
    lo, _ = marks["phases"]["wave"]
    notice = marks.get("notice") or lo + config.phase / 2
    gone = marks.get("gone") or notice + config.notice
    limit = LIMIT * report["wave"]["before"]["ttft_p99"]
    during = [r for r in records if notice <= r["start"] <= gone + 10 and r["ttft"] is not None]
    stayed = [r["ttft"] for r in during if _region(r) == r["fleet"] and r["ttft"] < AT_ONCE]
    cross_over = sum(t + config.rtt > limit for t in stayed) / len(stayed)
    fleet_a = [r for r in during if r["fleet"] == a]
    share_a = len(fleet_a) / len(during)
    slots = (config.replicas - config.spot[0]) * config.sim.max_batch
    service = report["service_s"]
    load = len(fleet_a) / (gone + 10 - notice) / (slots / service)
    best = (1.0, 0.0)
    for step in range(51):
        cross = step / 50
        kept = load * (1 - cross)
        local_over = 0.0
        if kept > 0.01:
            if kept >= 0.999:
                continue
            pick = random.Random(3)
            waits = queue_waits(kept, slots, service, arrivals=arrivals)
            local_over = sum(pick.choice(stayed) + w > limit for w in waits) / len(waits)
        over = share_a * (cross * cross_over + (1 - cross) * local_over)
        best = min(best, (over, cross))
    return Floor(
        limit_s=round(limit, 4),
        load=round(load, 3),
        share_a=round(share_a, 3),
        cross_over=round(cross_over, 3),
        least_over=round(best[0], 4),
        at_cross=best[1],
    )


def _region(record: dict[str, Any]) -> str:
    replica: str = record["replica"]
    return replica.rsplit("-", 1)[0]


def _one(run: Path, pattern: str) -> Any:
    (path,) = sorted(run.glob(pattern))[-1:]
    return json.loads(path.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.regions.floor", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="directories of regions runs")
    args = parser.parse_args(argv)
    for run in args.runs:
        result = floor(run)
        print(
            f"{run}: limit {1000 * result.limit_s:.0f} ms; fleet A at {result.load:.2f} of its "
            f"slots left, {result.share_a:.0%} of the wave; a crossing request passes the "
            f"limit with chance {result.cross_over:.2f}; least share over the limit "
            f"{result.least_over:.1%} (at {result.at_cross:.0%} of fleet A sent across)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
