"""Overflow in RDS: the route entries that send a share of a route's requests to a paid pool.

Each is the entry it stands in front of, with a runtime fraction (the share kvpilot decided,
``signals.overflow``; Envoy draws per request) and the aggregate cluster of the paid pool
that takes the overflow now. The aggregate goes on to the other paid pools and ends at the
route's replicas, and the entry's retries move across its priorities, so a 429 from the paid
pool is retried on the next one, then on the replicas, within the same request. A change of
share or of paid pool is a route change alone: no cluster is rebuilt, no connection drained.
"""

from __future__ import annotations

from dataclasses import replace

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.type.v3 import percent_pb2

from compiler.plan import PlanRoute
from xdsserver.translate.entries import route_entry

OVERFLOW_SUFFIX = "/overflow"
"""Suffix of an overflow entry's name (and of its stat prefix)."""


def overflow_runtime_key(route: PlanRoute, *, sessions: bool) -> str:
    """The runtime key of an overflow share, which an operator may override on one Envoy
    through its admin ``/runtime_modify`` (0 stops the overflow there)."""
    kind = "sessions" if sessions else "requests"
    return f"kvpilot.overflow.{route.name.replace('/', '.')}.{kind}"


def overflow_entry(
    route: PlanRoute,
    name: str,
    match: route_components_pb2.RouteMatch,
    body_limit: int,
    *,
    sessions: bool,
) -> route_components_pb2.Route:
    """The entry that sends the overflow share of the requests `match` takes to the paid pool:
    of conversations (`sessions`, `match` requires the session header) or of the rest."""
    overflow = route.overflow
    assert overflow is not None and overflow.cluster
    share = overflow.sessions if sessions else overflow.plain
    fraction = route_components_pb2.RouteMatch()
    fraction.CopyFrom(match)
    fraction.runtime_fraction.CopyFrom(
        base_pb2.RuntimeFractionalPercent(
            default_value=percent_pb2.FractionalPercent(
                numerator=round(share * 1_000_000),
                denominator=percent_pb2.FractionalPercent.MILLION,
            ),
            runtime_key=overflow_runtime_key(route, sessions=sessions),
        )
    )
    paid = replace(
        route,
        cluster=overflow.cluster,
        # A provider needs its own Host header (the endpoint's hostname).
        host_rewrite=True,
        # Retries move across the aggregate's priorities: the next paid pool, the replicas.
        tiers=max(route.tiers, overflow.members),
    )
    entry = route_entry(
        paid, name + OVERFLOW_SUFFIX, fraction, affinity=None, body_limit=body_limit
    )
    entry.stat_prefix = route.short_name + OVERFLOW_SUFFIX.replace("/", ".")
    return entry
