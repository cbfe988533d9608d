"""The adapters benchmark's settings (`bench.adapters.run` runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from replicasim.simulator import SimConfig


@dataclass(frozen=True)
class AdaptersConfig:
    """The scenario and the run."""

    replicas: int = 8
    adapters: int = 40
    zipf: float = 1.0
    """Popularity exponent: adapter k (from 1) is asked for in proportion to 1 / k**zipf."""
    max_loaded: int = 8
    """Adapters a replica holds at once (vLLM --max-loras)."""
    load_time: float = 0.5
    """Seconds to load an adapter."""
    rate: float = 24.0
    """Requests per second, Poisson arrivals."""
    requests: int = 2000
    max_tokens: int = 24
    seed: int = 1
    agent_interval: float = 0.5
    """Seconds between the agent's scrapes (metrics and model lists)."""
    warmup: float = 20.0
    """Seconds from the start after which requests count as steady state: the report gives
    every number for the whole run and for the steady part, when every popular adapter has
    been loaded somewhere once."""
    sim: SimConfig = field(default_factory=SimConfig)
    policies: tuple[str, ...] = ("blind", "aware")
    out_dir: Path = Path("bench/results")


def default_config(*, short: bool = False) -> AdaptersConfig:
    """The benchmark's settings; ``short`` is a smoke run of a few hundred requests."""
    return AdaptersConfig(requests=300, rate=20.0, warmup=5.0) if short else AdaptersConfig()
