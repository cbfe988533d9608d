"""Service classes in RDS: each class's match, the entry that sheds, diverts or queues its
restricted share, and the names of the stats and runtime keys an operator reads or sets."""

from __future__ import annotations

import re
from dataclasses import replace

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.type.matcher.v3 import regex_pb2, string_pb2
from envoy.type.v3 import percent_pb2

from compiler.plan import PlanClass, PlanRoute
from xdsserver.translate.entries import route_entry
from xdsserver.translate.listeners import SERVICE_CLASS, SHED_STATUS
from xdsserver.translate.protos import pack
from xdsserver.translate.ratelimits import counter


def class_stat_prefix(route: PlanRoute, plan_class: PlanClass) -> str:
    """The stat prefix of a class's entries on a route: ``<route>.<class>``."""
    return f"{route.short_name}.{plan_class.name}"


def admission_runtime_key(route: PlanRoute, plan_class: PlanClass) -> str:
    """The runtime key of a restricted class's fraction, which an operator may override on
    one Envoy through its admin ``/runtime_modify``."""
    return f"kvpilot.admission.{route.name.replace('/', '.')}.{plan_class.name}"


RESTRICTED_VERB = {"divert": "diverted", "queue": "queued", "shed": "shed"}
"""What a restricted entry's stats call its requests, by class action."""


def class_stats(vhost: str, route: PlanRoute, plan_class: PlanClass) -> dict[str, str]:
    """Envoy's counters of one class on one route (as Envoy names them in ``/stats``), by
    what they count: ``admitted`` (served by the route's own pool), and for a class that can
    be restricted ``shed``, ``diverted`` or ``queued``; ``queueLength`` for a queued class.
    kvpilot does not count requests itself: these are where an operator reads them."""
    prefix = class_stat_prefix(route, plan_class)
    stats = {"admitted": f"vhost.{vhost}.route.{prefix}.upstream_rq_completed"}
    verb = RESTRICTED_VERB.get(plan_class.action)
    if verb == "shed":
        stats["shed"] = f"{prefix}.shed.http_local_rate_limit.enabled"
    elif verb is not None:
        stats[verb] = f"vhost.{vhost}.route.{prefix}.{verb}.upstream_rq_completed"
    if plan_class.action == "queue":
        stats["queueLength"] = f"cluster.{plan_class.target_cluster}.upstream_rq_pending_active"
    return stats


def selects(plan_class: PlanClass) -> bool:
    """True for a class with a match of its own; False for the route's fallback class."""
    return bool(plan_class.headers or plan_class.tenants)


def with_class(
    match: route_components_pb2.RouteMatch, plan_class: PlanClass, tenant_header: str
) -> route_components_pb2.RouteMatch:
    out = route_components_pb2.RouteMatch()
    out.CopyFrom(match)
    for name, value in plan_class.headers:
        out.headers.append(
            route_components_pb2.HeaderMatcher(
                name=name, string_match=string_pb2.StringMatcher(exact=value)
            )
        )
    if len(plan_class.tenants) == 1:
        tenant = string_pb2.StringMatcher(exact=plan_class.tenants[0])
        out.headers.append(
            route_components_pb2.HeaderMatcher(name=tenant_header, string_match=tenant)
        )
    elif plan_class.tenants:
        pattern = "^(" + "|".join(re.escape(t) for t in plan_class.tenants) + ")$"
        tenants = string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=pattern))
        out.headers.append(
            route_components_pb2.HeaderMatcher(name=tenant_header, string_match=tenants)
        )
    return out


def shed_message(plan_class: PlanClass) -> str:
    """What a shed request is told (the ``message`` of its OpenAI error)."""
    return (
        f"The model fleet is saturated and requests of class {plan_class.name!r} are being "
        f"shed; retry after {plan_class.retry_after} seconds."
    )


def restricted_entry(
    route: PlanRoute,
    plan_class: PlanClass,
    name: str,
    match: route_components_pb2.RouteMatch,
    body_limit: int,
) -> route_components_pb2.Route:
    """The entry that takes the restricted share of a class: a runtime fraction of the
    class's requests (Envoy draws per request), shed with a 429 or sent to the divert route.

    The fraction's default value is what kvpilot decided and travels in RDS; the runtime key
    lets an operator override it on one Envoy (admin ``/runtime_modify``) in an emergency.
    """
    restricted = route_components_pb2.RouteMatch()
    restricted.CopyFrom(match)
    restricted.runtime_fraction.CopyFrom(
        base_pb2.RuntimeFractionalPercent(
            default_value=percent_pb2.FractionalPercent(
                numerator=round((1.0 - plan_class.admitted) * 1_000_000),
                denominator=percent_pb2.FractionalPercent.MILLION,
            ),
            runtime_key=admission_runtime_key(route, plan_class),
        )
    )
    if plan_class.action in ("divert", "queue"):
        # Diverted: another route's cluster; queued: this route's cluster twin whose circuit
        # breakers hold the class in Envoy.
        elsewhere = replace(
            route,
            cluster=plan_class.target_cluster,
            host_rewrite=route.host_rewrite or plan_class.action == "divert",
        )
        verb = RESTRICTED_VERB[plan_class.action]
        entry = route_entry(
            elsewhere,
            f"{name}/{plan_class.action}",
            restricted,
            affinity=None,
            body_limit=body_limit,
        )
        entry.stat_prefix = f"{class_stat_prefix(route, plan_class)}.{verb}"
        return entry
    # Envoy's own status for a shed request; the listener's local-reply mapper turns it into
    # a 429 with an OpenAI error body, so a shed reply is never mistaken for a rate limit's.
    entry = route_components_pb2.Route(
        name=f"{name}/shed",
        match=restricted,
        direct_response=route_components_pb2.DirectResponseAction(
            status=SHED_STATUS, body=base_pb2.DataSource(inline_string=shed_message(plan_class))
        ),
        response_headers_to_add=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="retry-after", value=str(plan_class.retry_after)),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
    )
    # Direct responses leave no route stats; a local rate limit that never enforces counts
    # them instead: <route>.<class>.shed.http_local_rate_limit.enabled.
    entry.typed_per_filter_config[SERVICE_CLASS].CopyFrom(
        pack(counter(f"{class_stat_prefix(route, plan_class)}.{RESTRICTED_VERB['shed']}"))
    )
    return entry
