"""RDS: virtual hosts and route entries; model matching, session and prompt-prefix affinity,
retries across tiers, rate limits, service classes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import replace

from envoy.config.core.v3 import (
    base_pb2,
)
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2
from envoy.type.matcher.v3 import value_pb2 as value_matcher_pb2
from envoy.type.v3 import percent_pb2, token_bucket_pb2
from google.protobuf import wrappers_pb2

from policies.models import ClassBudget, RateLimit
from policies.plan import PlanClass, PlanListener, PlanRoute, PlanVirtualHost
from xdsserver.translate.clusters import AFFINITY_SUFFIX
from xdsserver.translate.listeners import (
    LOCAL_RATELIMIT,
    LUA,
    MODEL_METADATA_KEY,
    MODEL_METADATA_NAMESPACE,
    SERVICE_CLASS,
    SHED_STATUS,
)
from xdsserver.translate.protos import duration, pack

PREFIX_KEY_HEADER = "x-kvpilot-prefix-key"
"""Set by Envoy's Lua filter from the prompt's first characters when no session header is sent."""
TENANT_DESCRIPTOR = "tenant"
MAX_TENANTS = 10_000
"""Most distinct tenant buckets one route keeps per Envoy (least recently used are dropped)."""
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600}
_RETRY_ON = {
    "5xx": "5xx",
    "reset": "reset",
    "connect-failure": "connect-failure",
    "gateway-error": "gateway-error",
    "refused-stream": "refused-stream",
    "429": "retriable-status-codes",
}
UNKNOWN_MODEL_BODY = json.dumps(
    {
        "error": {
            "message": "The model in this request is not served here.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
)


MODELS_PATH = "/v1/models"
_DIRECT_BODY_DEFAULT_LIMIT = 4096
"""Envoy refuses direct-response bodies over this unless the route configuration raises it."""


def models_list_body(models: Iterable[str]) -> str:
    """OpenAI's ``GET /v1/models`` answer for the models a virtual host serves. ``created`` is
    0: the models' age is not known to kvpilot, and a stable body keeps the config's hash."""
    return json.dumps(
        {
            "object": "list",
            "data": [
                {"id": model, "object": "model", "created": 0, "owned_by": "kvpilot"}
                for model in models
            ],
        }
    )


def translate_route_configuration(listener: PlanListener) -> route_pb2.RouteConfiguration:
    """One virtual host per RoutingPolicy on this listener."""
    config = route_pb2.RouteConfiguration(
        name=listener.name,
        virtual_hosts=[
            _virtual_host(vhost, listener.max_request_body_bytes)
            for vhost in listener.virtual_hosts
        ],
    )
    largest = max(
        (len(models_list_body(vhost.served_models)) for vhost in listener.virtual_hosts),
        default=0,
    )
    if largest > _DIRECT_BODY_DEFAULT_LIMIT:
        config.max_direct_response_body_size_bytes.value = largest
    return config


def _virtual_host(vhost: PlanVirtualHost, body_limit: int) -> route_components_pb2.VirtualHost:
    # OpenAI clients and chat UIs list models first: Envoy answers from config, before any
    # route could send the request to a replica.
    routes: list[route_components_pb2.Route] = [_models_list_route(vhost.served_models)]
    for route in vhost.routes:
        routes.extend(_routes(route, vhost.model_header, body_limit))
    if vhost.routes_by_model:
        routes.append(_unknown_model_route())
    return route_components_pb2.VirtualHost(
        name=vhost.name, domains=list(vhost.domains), routes=routes
    )


def _routes(
    route: PlanRoute, model_header: str, body_limit: int
) -> Iterable[route_components_pb2.Route]:
    """Envoy route entries for one plan route.

    A route that selects by model gets two entries per model: the override header first, then
    the body field, which counts only when the override header is absent. With session
    affinity each of those is preceded by an entry that requires the session header and
    targets the consistent-hash cluster.

    With service classes, that set of entries is repeated for each class, the class's header
    and tenant matches added, in the order of ``route.classes``: Envoy takes the first entry
    that matches, so a request lands in the first class that claims it and otherwise in the
    route's fallback class (last, with no class match). A class that is being restricted
    gets one more entry in front of its set, which matches the restricted share of its
    requests (a runtime fraction) and sheds or diverts them.
    """
    matches: list[route_components_pb2.RouteMatch] = []
    if route.models:
        for model in route.models:
            matches.append(_match(route, header=(model_header, model)))
            matches.append(_match(route, model=model, unless_header=model_header))
    else:
        matches.append(_match(route))
    for plan_class in route.classes or (None,):
        for index, base in enumerate(matches):
            name = f"{route.name}#{index}"
            match = base
            if plan_class is not None:
                match = _with_class(base, plan_class, route.tenant_header)
                name += f"@{plan_class.name}" + ("" if _selects(plan_class) else "/fallback")
                if plan_class.sheds:
                    yield _restricted_entry(route, plan_class, name, match, body_limit)
            yield from _entries(route, plan_class, name, match, body_limit)


def _entries(
    route: PlanRoute,
    plan_class: PlanClass | None,
    name: str,
    match: route_components_pb2.RouteMatch,
    body_limit: int,
) -> Iterable[route_components_pb2.Route]:
    """The entries that serve one match: affinity first, then prompt-prefix, then plain."""
    affinity = route.affinity
    entries = []
    if affinity is not None:
        entries.append(
            _route_entry(
                route,
                f"{name}/affinity",
                _with_header(match, affinity.header),
                affinity=affinity.header,
                body_limit=body_limit,
            )
        )
        if affinity.prefix_hash_chars:
            entries.append(
                _route_entry(
                    route,
                    f"{name}/prefix",
                    _with_header(match, PREFIX_KEY_HEADER),
                    affinity=PREFIX_KEY_HEADER,
                    body_limit=body_limit,
                )
            )
    entry = _route_entry(route, name, match, affinity=None, body_limit=body_limit)
    if affinity is not None and affinity.prefix_hash_chars:
        # No session header: the Lua filter derives a key from the prompt's first
        # characters and sets PREFIX_KEY_HEADER; changing headers clears Envoy's route
        # cache, so the request is matched again and takes the "/prefix" entry above.
        entry.typed_per_filter_config[LUA].CopyFrom(
            pack(
                lua_pb2.LuaPerRoute(
                    source_code=base_pb2.DataSource(
                        inline_string=prefix_key_lua(affinity.header, affinity.prefix_hash_chars)
                    )
                )
            )
        )
    entries.append(entry)
    if plan_class is not None:
        for out in entries:
            # Per-class stats from Envoy itself: vhost.<policy>.route.<route>.<class>.upstream_rq_*
            # counts what the class was admitted and times it (upstream_rq_time).
            out.stat_prefix = class_stat_prefix(route, plan_class)
            if plan_class.budget is not None:
                out.typed_per_filter_config[SERVICE_CLASS].CopyFrom(
                    pack(_class_budget(plan_class.budget, route.tenant_header, out.stat_prefix))
                )
    return entries


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


def _selects(plan_class: PlanClass) -> bool:
    """True for a class with a match of its own; False for the route's fallback class."""
    return bool(plan_class.headers or plan_class.tenants)


def _with_class(
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


def _restricted_entry(
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
        entry = _route_entry(
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
        pack(_counter(f"{class_stat_prefix(route, plan_class)}.{RESTRICTED_VERB['shed']}"))
    )
    return entry


def _counter(stat_prefix: str) -> local_rate_limit_pb2.LocalRateLimit:
    """A local rate limit that checks every request and enforces on none: a request counter."""
    return local_rate_limit_pb2.LocalRateLimit(
        stat_prefix=stat_prefix,
        token_bucket=token_bucket_pb2.TokenBucket(
            max_tokens=1,
            tokens_per_fill=wrappers_pb2.UInt32Value(value=1),
            fill_interval=duration(3600),
        ),
        filter_enabled=base_pb2.RuntimeFractionalPercent(
            default_value=percent_pb2.FractionalPercent(
                numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED
            )
        ),
        filter_enforced=base_pb2.RuntimeFractionalPercent(
            default_value=percent_pb2.FractionalPercent(
                numerator=0, denominator=percent_pb2.FractionalPercent.HUNDRED
            )
        ),
    )


def _with_header(
    match: route_components_pb2.RouteMatch, header: str
) -> route_components_pb2.RouteMatch:
    out = route_components_pb2.RouteMatch()
    out.CopyFrom(match)
    out.headers.append(route_components_pb2.HeaderMatcher(name=header, present_match=True))
    return out


def prefix_key_lua(session_header: str, chars: int) -> str:
    """Lua run by Envoy on requests without a session header: a hash of the first ``chars``
    characters of the prompt (from the ``messages`` or ``prompt`` field on, as sent) becomes
    the PREFIX_KEY_HEADER, so requests that share a long prefix (a system prompt, a document)
    hash to the same replica and meet its prefix cache.

    The trade-off of ``chars``: too small and unrelated conversations that merely share a
    short system prompt all pile onto one replica (bounded load then spills them over); too
    large and requests sharing a long prefix still differ within the window and scatter.
    The hash is computed in Lua so the header stays short and printable whatever the prompt
    holds; Envoy then hashes the header onto the ring like a session ID.
    """
    return f"""-- kvpilot: prompt-prefix affinity key ({chars} characters)
function envoy_on_request(handle)
  local headers = handle:headers()
  if headers:get("{session_header}") ~= nil or headers:get("{PREFIX_KEY_HEADER}") ~= nil then
    return
  end
  local body = handle:body()
  if body == nil then
    return
  end
  local text = body:getBytes(0, math.min(body:length(), {chars} + 65536))
  local start = string.find(text, '"messages"', 1, true) or string.find(text, '"prompt"', 1, true)
  if start == nil then
    return
  end
  local window = string.sub(text, start, start + {chars} - 1)
  local hash = 7
  for i = 1, #window do
    hash = (hash * 31 + string.byte(window, i)) % 2147483647
  end
  -- Header handles taken before body() are invalid after it yields: fetch them again.
  handle:headers():add("{PREFIX_KEY_HEADER}", string.format("%x", hash))
end
"""


def _match(
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


def _route_entry(
    route: PlanRoute,
    name: str,
    match: route_components_pb2.RouteMatch,
    *,
    affinity: str | None,
    body_limit: int,
) -> route_components_pb2.Route:
    """One route entry; ``affinity`` names the header to hash on (consistent-hash cluster)."""
    action = route_components_pb2.RouteAction(
        cluster=route.cluster + (AFFINITY_SUFFIX if affinity else ""),
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
            pack(_rate_limit(route.rate_limit, name))
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


def _rate_limit(limit: RateLimit, stat_name: str) -> local_rate_limit_pb2.LocalRateLimit:
    """A token bucket per route, or per tenant header value when the limit names one.

    Tenant buckets are dynamic descriptors: an entry with an empty value matches any value and
    each distinct value gets its own bucket of the same size.
    """
    bucket = _token_bucket(limit)
    always = percent_pb2.FractionalPercent(
        numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED
    )
    config = local_rate_limit_pb2.LocalRateLimit(
        stat_prefix="rate_limit",
        token_bucket=bucket,
        filter_enabled=base_pb2.RuntimeFractionalPercent(default_value=always),
        filter_enforced=base_pb2.RuntimeFractionalPercent(default_value=always),
        enable_x_ratelimit_headers=ratelimit_pb2.DRAFT_VERSION_03,
    )
    if limit.tenant_header:
        config.rate_limits.append(
            route_components_pb2.RateLimit(
                actions=[
                    route_components_pb2.RateLimit.Action(
                        request_headers=route_components_pb2.RateLimit.Action.RequestHeaders(
                            header_name=limit.tenant_header,
                            descriptor_key=TENANT_DESCRIPTOR,
                            skip_if_absent=True,
                        )
                    )
                ]
            )
        )
        config.descriptors.append(
            ratelimit_pb2.LocalRateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=TENANT_DESCRIPTOR, value="")],
                token_bucket=_token_bucket(limit),
            )
        )
        config.max_dynamic_descriptors.value = MAX_TENANTS
        # A tenant's request spends only its own bucket; requests without the header share
        # the route's bucket.
        config.always_consume_default_token_bucket.value = False
    return config


def _class_budget(
    budget: ClassBudget, tenant_header: str, stat_prefix: str
) -> local_rate_limit_pb2.LocalRateLimit:
    """A class's budget as a token bucket, and each tenant's share of it as a bucket of its
    own (dynamic descriptors, as for a route's tenant buckets). A tenant's request spends
    from its own bucket and from the class's, so no tenant takes more than its share and the
    tenants together no more than the budget."""
    limit = RateLimit(
        requests=budget.requests,
        unit=budget.unit,
        burst=budget.burst,
        tenant_header=tenant_header,
    )
    share = RateLimit(
        requests=max(1, budget.requests * budget.tenant_share // 100),
        unit=budget.unit,
        burst=max(1, (budget.burst or budget.requests) * budget.tenant_share // 100),
    )
    config = _rate_limit(limit, f"{stat_prefix}.budget")
    config.stat_prefix = f"{stat_prefix}.budget"
    del config.descriptors[:]
    config.descriptors.append(
        ratelimit_pb2.LocalRateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=TENANT_DESCRIPTOR, value="")],
            token_bucket=_token_bucket(share),
        )
    )
    config.always_consume_default_token_bucket.value = True
    return config


def _token_bucket(limit: RateLimit) -> token_bucket_pb2.TokenBucket:
    return token_bucket_pb2.TokenBucket(
        max_tokens=limit.burst or limit.requests,
        tokens_per_fill=wrappers_pb2.UInt32Value(value=limit.requests),
        fill_interval=duration(_UNIT_SECONDS[limit.unit]),
    )


def _unknown_model_route() -> route_components_pb2.Route:
    """Requests for a model no route serves get OpenAI's 404, not an empty 503."""
    return _json_direct_response(
        "unknown-model",
        route_components_pb2.RouteMatch(prefix="/"),
        status=404,
        body=UNKNOWN_MODEL_BODY,
    )


def _models_list_route(models: tuple[str, ...]) -> route_components_pb2.Route:
    match = route_components_pb2.RouteMatch(
        path=MODELS_PATH,
        headers=[
            route_components_pb2.HeaderMatcher(
                name=":method", string_match=string_pb2.StringMatcher(exact="GET")
            )
        ],
    )
    return _json_direct_response("models", match, status=200, body=models_list_body(models))


def _json_direct_response(
    name: str, match: route_components_pb2.RouteMatch, *, status: int, body: str
) -> route_components_pb2.Route:
    return route_components_pb2.Route(
        name=name,
        match=match,
        direct_response=route_components_pb2.DirectResponseAction(
            status=status, body=base_pb2.DataSource(inline_string=body)
        ),
        response_headers_to_add=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="content-type", value="application/json"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
    )
