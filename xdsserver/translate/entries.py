"""One Envoy route entry: its match (path prefix, headers, the model from the body's metadata)
and its action (cluster, hash policy, timeouts, retries across tiers, rate limit)."""

from __future__ import annotations

from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2
from envoy.type.matcher.v3 import value_pb2 as value_matcher_pb2
from google.protobuf import wrappers_pb2

from compiler.plan import PlanRoute
from xdsserver.translate.clusters import AFFINITY_SUFFIX, SATURATED_SUFFIX, twin_suffix
from xdsserver.translate.listeners import (
    LOCAL_RATELIMIT,
)
from xdsserver.translate.metadata import MODEL_METADATA_KEY, MODEL_METADATA_NAMESPACE
from xdsserver.translate.protos import duration, pack
from xdsserver.translate.ratelimits import rate_limit

_RETRY_ON = {
    "5xx": "5xx",
    "reset": "reset",
    "connect-failure": "connect-failure",
    "gateway-error": "gateway-error",
    "refused-stream": "refused-stream",
    "429": "retriable-status-codes",
}


def match_of(
    route: PlanRoute,
    *,
    header: tuple[str, str] | None = None,
    model: str | None = None,
    unless_header: str | None = None,
) -> route_components_pb2.RouteMatch:
    match = route_components_pb2.RouteMatch(prefix=route.path_prefix)
    for name, value in (*route.headers, *([header] if header else [])):
        match.headers.append(
            route_components_pb2.HeaderMatcher(
                name=name, string_match=string_pb2.StringMatcher(exact=value)
            )
        )
    if unless_header is not None:
        # Envoy takes the first entry that matches: without this, the body entry of an
        # earlier route would beat the override header's entry of a later route.
        match.headers.append(
            route_components_pb2.HeaderMatcher(
                name=unless_header, present_match=True, invert_match=True
            )
        )
    if model is not None:
        match.dynamic_metadata.append(
            metadata_pb2.MetadataMatcher(
                filter=MODEL_METADATA_NAMESPACE,
                path=[metadata_pb2.MetadataMatcher.PathSegment(key=MODEL_METADATA_KEY)],
                value=value_matcher_pb2.ValueMatcher(
                    string_match=string_pb2.StringMatcher(exact=model)
                ),
            )
        )
    return match


def route_entry(
    route: PlanRoute,
    name: str,
    match: route_components_pb2.RouteMatch,
    *,
    affinity: str | None,
    body_limit: int,
) -> route_components_pb2.Route:
    """One route entry; ``affinity`` names the header to hash on (consistent-hash cluster)."""
    suffix = ""
    if affinity:
        suffix = SATURATED_SUFFIX if route.saturated else AFFINITY_SUFFIX
        if route.bound and route.affinity is not None:
            suffix = twin_suffix(route.affinity, route.bound)
    action = route_components_pb2.RouteAction(
        cluster=route.cluster + suffix,
        timeout=duration(route.timeouts.request),
        idle_timeout=duration(route.timeouts.idle),
        retry_policy=_retry_policy(route, affinity=affinity is not None),
    )
    if affinity:
        action.hash_policy.append(
            route_components_pb2.RouteAction.HashPolicy(
                header=route_components_pb2.RouteAction.HashPolicy.Header(header_name=affinity)
            )
        )
    if route.host_rewrite:
        # The chosen endpoint's hostname: a provider's name, or its pool's hostRewrite.
        # Endpoints without one keep the client's Host header.
        action.auto_host_rewrite.value = True
    out = route_components_pb2.Route(name=name, match=match, route=action)
    if route.rate_limit is not None:
        out.typed_per_filter_config[LOCAL_RATELIMIT].CopyFrom(
            pack(rate_limit(route.rate_limit, name))
        )
    # Long prompts are the norm: let the model-routing filter buffer the whole body.
    out.request_body_buffer_limit.value = body_limit
    return out


def _retry_policy(route: PlanRoute, *, affinity: bool) -> route_components_pb2.RetryPolicy:
    retries = route.retries
    policy = route_components_pb2.RetryPolicy(
        retry_on=",".join(dict.fromkeys(_RETRY_ON[condition] for condition in retries.retry_on)),
        num_retries=wrappers_pb2.UInt32Value(value=retries.attempts),
        retry_host_predicate=[
            route_components_pb2.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        # A consistent hash picks the same host again on retry unless asked to re-pick many
        # times; plain balancers need only a few attempts.
        host_selection_retry_max_attempts=50 if affinity else 5,
        retry_back_off=route_components_pb2.RetryPolicy.RetryBackOff(
            base_interval=duration(retries.backoff_base),
            max_interval=duration(retries.backoff_base * 10),
        ),
    )
    if "429" in retries.retry_on:
        policy.retriable_status_codes.append(429)
    if retries.per_try_timeout:
        policy.per_try_timeout.CopyFrom(duration(retries.per_try_timeout))
    if route.tiers > 1:
        # Move to the next tier on retry even when the failed tier still looks healthy
        # (a single priority-0 host answering 429, for example).
        policy.retry_priority.CopyFrom(
            route_components_pb2.RetryPolicy.RetryPriority(
                name="envoy.retry_priorities.previous_priorities",
                typed_config=pack(
                    previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=1)
                ),
            )
        )
    return policy


def with_header(
    match: route_components_pb2.RouteMatch, header: str
) -> route_components_pb2.RouteMatch:
    out = route_components_pb2.RouteMatch()
    out.CopyFrom(match)
    out.headers.append(route_components_pb2.HeaderMatcher(name=header, present_match=True))
    return out
