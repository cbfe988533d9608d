"""The regions benchmark's settings: two regions of simulated replicas, the inter-region round
trip, the loads of its phases and how long each lasts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from replicasim.simulator import SimConfig

POLICIES = ("blind", "fill", "aware")
"""``blind``: the fleets have no locality (today's behaviour without a Fleet locality);
``fill``: each fleet declares its region, and its spill follows its replicas' batch fill alone
(``spillSignal: fill``, the loop before feed-forward); ``aware``: the same with the default
feed-forward from the fleet's arrival rate against its locality's capacity
(``signals.spill``)."""
EXTRA_POLICIES = ("gate",)
"""Run only when named. ``gate``: no locality; each region's replicas are a pool of their
own behind a gate at every reported slot (``overflow.maxInFlight: auto``, ``gateShare: 1``,
no share), and the other region's replicas, named by DNS (an external pool), take what the
gate turns away: a request crosses only when it finds its region's batch slots taken
(docs/regions.md, "The wave's line and the round trip"). The external pool knows no drain:
a drained replica of the other region still takes the requests that cross to it."""


@dataclass(frozen=True)
class RegionsConfig:
    """Two regions (A then B) of ``replicas`` each, one Envoy fleet per region."""

    regions: tuple[str, str] = ("us-east", "eu-west")
    replicas: int = 4
    """Replicas per region."""
    spot: tuple[int, int] = (2, 1)
    """Spot replicas per region (the last of each region's replicas); the wave preempts them
    all: 3 of 8."""
    rtt: float = 0.08
    """Simulated inter-region round trip, seconds (40 ms each way)."""
    sim: SimConfig = field(
        default_factory=lambda: SimConfig(
            max_batch=16,
            kv_blocks=8192,
            decode_base=0.05,
            decode_per_seq=0.0005,
            stream_interval=1.0,
        )
    )
    """Batches of 16: a region has 64 slots, enough that its batch fill follows its load
    rather than the luck of a few arrivals. Slow steps (50 ms) and a chunk a second keep the
    request rate, and so the load generator's and simulators' CPU, low on a shared machine:
    at 130% a region gets about 12 requests a second."""
    prompt_words: int = 60
    max_tokens: int = 128
    steady_load: float = 0.7
    """Each region's own load in the steady phase, as a share of its capacity."""
    overload: float = 1.3
    """Region A's load in the regional overload phase (region B stays at ``steady_load``)."""
    wave_load: float = 0.45
    """Each region's load in the spot wave phase. At 70% the 5 replicas left after the wave
    would have 5/8 = 62.5% of the capacity for 70% of it: the wave could not be absorbed
    (and at 55% they ran at 88%, where queueing alone triples TTFT p99); at 45% they run at
    72%."""
    phase: float = 40.0
    """Seconds of the steady and region-down phases."""
    overload_phase: float = 80.0
    """Seconds of the regional overload, whose second half is measured. Its cross share is
    judged against the excess at the load that half achieved, and both are counts of Poisson
    arrivals: over 20 s (a 40 s phase) fleet A's some 240 requests put a standard deviation of
    about 5 points on the excess and 3 on the cross share by chance alone; over 40 s, 3.5
    and 2."""
    notice: float = 30.0
    """Seconds between the spot preemption notice and the replicas' end."""
    recovery: float = 30.0
    """Seconds of the recovery phase after region A comes back."""
    agent_interval: float = 0.5
    """Seconds between the agents' scrapes."""
    policies: tuple[str, ...] = POLICIES
    seed: int = 1
    out_dir: Path = Path("bench/results")


def default_regions_config(*, short: bool = False) -> RegionsConfig:
    """The full run, or a short one (a smoke test: the numbers are not the claim)."""
    if short:
        return RegionsConfig(phase=14.0, overload_phase=14.0, notice=8.0, recovery=10.0)
    return RegionsConfig()


__all__ = ["EXTRA_POLICIES", "POLICIES", "RegionsConfig", "default_regions_config"]
