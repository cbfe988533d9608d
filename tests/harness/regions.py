"""Two regions in one policy state: pool ``llama`` with two replicas in region ``us``
(10.0.1.1 and 10.0.1.2) and two in ``eu`` (10.0.2.x), policy ``chat`` with one route
``chat`` to it, and fleets ``us`` and ``eu``, each placed in its own region. The spill tests
read each fleet's priorities and spill share from the plan compiled from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies import Fleet, Pool, RoutingPolicy
from policies.models import PolicyObject
from signals import PolicyState
from signals.telemetry import TelemetryRecord

REGIONS = ((1, "us"), (2, "eu"))
"""Each region with the third octet of its replicas' addresses."""


def two_region_objects(
    spill_signal: str | None = None, draining: tuple[str, ...] = ()
) -> list[PolicyObject]:
    """The pool, the policy and the two fleets; ``spill_signal`` sets the fleets'
    ``spillSignal`` (left out when None: the default); the replicas whose address is in
    `draining` are draining."""
    endpoints = [
        {
            "address": f"10.0.{r}.{i}",
            "port": 8000,
            "locality": {"region": region},
            "health": "draining" if f"10.0.{r}.{i}" in draining else "healthy",
        }
        for r, region in REGIONS
        for i in (1, 2)
    ]
    fleets: list[PolicyObject] = []
    for _, region in REGIONS:
        spec: dict[str, Any] = {"locality": {"region": region}}
        if spill_signal is not None:
            spec["spillSignal"] = spill_signal
        fleets.append(
            Fleet.model_validate({"kind": "Fleet", "metadata": {"name": region}, "spec": spec})
        )
    return [
        Pool.model_validate(
            {
                "kind": "Pool",
                "metadata": {"name": "llama"},
                "spec": {"endpoints": endpoints, "telemetry": {"maxAge": "5s"}},
            }
        ),
        RoutingPolicy.model_validate(
            {
                "kind": "RoutingPolicy",
                "metadata": {"name": "chat"},
                "spec": {
                    "fleets": [region for _, region in REGIONS],
                    "routes": [{"name": "chat", "tiers": [["llama"]]}],
                },
            }
        ),
        *fleets,
    ]


def two_region_state(
    telemetry: Mapping[str, TelemetryRecord],
    *,
    now: float = 100.0,
    spill_signal: str | None = None,
    draining: tuple[str, ...] = (),
    **live: Any,
) -> PolicyState:
    """The objects with ``telemetry`` (replica ``address:port`` to its record) for pool
    ``llama`` at time ``now``; ``live`` gives the other live fields (previous spill,
    arrivals, service times...)."""
    return PolicyState.from_objects(
        two_region_objects(spill_signal, draining),
        telemetry={"llama": dict(telemetry)},
        now=now,
        **live,
    )
