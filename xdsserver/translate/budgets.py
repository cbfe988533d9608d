"""Tenants past their budget in RDS: an entry in front of a route's own, matching the
tenant's requests (of one class or model, where the budget says so), that answers 429 in
OpenAI's format with Retry-After at the window's end, or sends them to a cheaper route."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime
from email.utils import format_datetime

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.type.matcher.v3 import string_pb2

from compiler.plan import PlanBudgetBlock, PlanRoute
from xdsserver.translate.classes import with_class
from xdsserver.translate.entries import route_entry
from xdsserver.translate.listeners import BUDGET_RESET_HEADER, BUDGET_STATUS


def _header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def budget_entries(
    route: PlanRoute,
    matches: Iterable[tuple[str, route_components_pb2.RouteMatch]],
    body_limit: int,
) -> Iterable[route_components_pb2.Route]:
    """The entries of every block of a route, one per (model, match) of the route that the
    block covers; they come before the route's own entries, so Envoy takes them first."""
    classes = {plan_class.name: plan_class for plan_class in route.classes}
    for block in route.budget_blocks:
        for index, (model, base) in enumerate(matches):
            if block.model and model != block.model:
                continue
            match = route_components_pb2.RouteMatch()
            match.CopyFrom(base)
            if block.service_class:
                match = with_class(match, classes[block.service_class], route.tenant_header)
            match.headers.append(
                route_components_pb2.HeaderMatcher(
                    name=route.tenant_header,
                    string_match=string_pb2.StringMatcher(exact=block.tenant),
                )
            )
            yield _entry(
                route, block, f"{route.name}#{index}/budget/{block.budget}", match, body_limit
            )


def _entry(
    route: PlanRoute,
    block: PlanBudgetBlock,
    name: str,
    match: route_components_pb2.RouteMatch,
    body_limit: int,
) -> route_components_pb2.Route:
    if block.divert_cluster:
        elsewhere = replace(route, cluster=block.divert_cluster, host_rewrite=True, rate_limit=None)
        entry = route_entry(elsewhere, name, match, affinity=None, body_limit=body_limit)
        entry.response_headers_to_add.append(_header("x-kvpilot-budget", block.budget))
        return entry
    reset = datetime.fromtimestamp(block.reset_at, UTC)
    return route_components_pb2.Route(
        name=name,
        match=match,
        direct_response=route_components_pb2.DirectResponseAction(
            status=BUDGET_STATUS, body=base_pb2.DataSource(inline_string=block.message)
        ),
        response_headers_to_add=[
            # An HTTP date is a valid Retry-After on its own; the accounting filter replaces
            # it with the seconds left, which more clients understand.
            _header("retry-after", format_datetime(reset, usegmt=True)),
            _header(BUDGET_RESET_HEADER, str(block.reset_at)),
            _header("x-kvpilot-budget", block.budget),
        ],
    )
