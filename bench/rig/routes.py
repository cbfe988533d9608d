"""The routing policies the benchmarks compare: one table of their routes, and the `Policy`
every benchmark's own table names them by.

Each benchmark picks from `standard_policies` (round robin, least request, session affinity
with bounded load, affinity with telemetry weights, ORCA) and renames or adds to them; so a
row called "affinity" means the same route in every report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from bench.rig.workload import SESSION_HEADER

PREFIX_HASH_CHARS = 1024
"""Prompt characters hashed for prompt-prefix affinity: the system message and the first
couple of hundred words of the document, enough to tell the documents apart."""

SESSION_AFFINITY: Mapping[str, Any] = {"header": SESSION_HEADER, "hashBalanceFactor": 150}
"""Session affinity on the session header, with bounded load (a replica takes at most 1.5x
the mean)."""


@dataclass(frozen=True)
class Policy:
    """One routing policy under test: the route fields that differ from the others."""

    key: str
    title: str
    route: Mapping[str, Any]
    workload: str = "chat"
    """Which of the routing benchmark's workloads it replays: ``chat`` (multi-turn) or
    ``docs``."""
    default: bool = True
    """Run unless the policies are named (``--policies``)."""
    weights_by_speed: bool = False
    """Static endpoint weights equal to each replica's true speed (the scenario's), an
    oracle no real router has."""
    scenarios: tuple[str, ...] = ()
    """The only scenarios it runs in (where it differs from another policy); empty: all."""

    def runs_in(self, scenario: str) -> bool:
        """Whether the policy replays `scenario` (``scenarios``)."""
        return not self.scenarios or scenario in self.scenarios


def standard_policies(affinity: Mapping[str, Any] = SESSION_AFFINITY) -> dict[str, Policy]:
    """The policies every benchmark compares, by key; the affinity ones use `affinity`."""
    return {
        p.key: p
        for p in (
            Policy("round_robin", "round robin", {"balancing": "round_robin"}),
            Policy("least_request", "least request", {"balancing": "least_request"}),
            Policy(
                "affinity",
                "affinity + bounded load",
                {"balancing": "least_request", "sessionAffinity": dict(affinity)},
            ),
            # Session affinity plus weights from live telemetry: `kvpilot agent` scrapes the
            # replicas into etcd, kvpilot turns queue depth and KV use into endpoint weights,
            # which the ring-hash twin cluster (the one session requests use) honours too.
            Policy(
                "affinity_telemetry",
                "affinity + telemetry weights",
                {"balancing": "telemetry", "sessionAffinity": dict(affinity)},
            ),
            # ORCA cannot combine with session affinity (one cluster has one load balancer),
            # so this is Envoy's client-side weighted round robin on the replicas' load
            # reports alone.
            Policy("orca", "ORCA weighted round robin (no affinity)", {"balancing": "orca"}),
        )
    }


def bounded_load(policy: Policy, factor: int, key: str, title: str) -> Policy:
    """`policy` with the bounded-load factor `factor` (percent of the mean load), under `key`:
    a sensitivity row, run only when named."""
    affinity = {**policy.route["sessionAffinity"], "hashBalanceFactor": factor}
    route = {**policy.route, "sessionAffinity": affinity}
    return replace(policy, key=key, title=title, route=route, default=False)
