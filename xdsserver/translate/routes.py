"""RDS: virtual hosts and route entries; model matching, session and prompt-prefix affinity,
retries across tiers, rate limits, service classes."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import replace

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.type.matcher.v3 import string_pb2

from compiler.plan import PlanClass, PlanListener, PlanRoute, PlanVirtualHost
from policies.names import gated_name
from xdsserver.translate.budgets import budget_entries
from xdsserver.translate.classes import class_stat_prefix, restricted_entry, selects, with_class
from xdsserver.translate.difficulty import response_headers, virtual_entries
from xdsserver.translate.entries import match_of, route_entry, with_header
from xdsserver.translate.escalation import escalation_entries
from xdsserver.translate.gate import SESSION_TRIES, gate_retries
from xdsserver.translate.listeners import LUA, SERVICE_CLASS
from xdsserver.translate.metadata import (
    MODEL_METADATA_KEY,
    MODEL_METADATA_NAMESPACE,
    PREFIX_KEY_HEADER,
)
from xdsserver.translate.overflow import OVERFLOW_SUFFIX, overflow_entry
from xdsserver.translate.protos import pack
from xdsserver.translate.ratelimits import class_budget
from xdsserver.translate.tracing import entry_tracing

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


def models_list_body(models: Iterable[str], parents: Mapping[str, str] | None = None) -> str:
    """OpenAI's ``GET /v1/models`` answer for the models a virtual host serves; a LoRA
    adapter names its base model in ``parent``, as vLLM lists it. ``created`` is 0: the
    models' age is not known to kvpilot, and a stable body keeps the config's hash."""
    parents = parents or {}
    return json.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvpilot",
                    **({"parent": parents[model]} if model in parents else {}),
                }
                for model in models
            ],
        }
    )


def translate_route_configuration(listener: PlanListener) -> route_pb2.RouteConfiguration:
    """One virtual host per RoutingPolicy on this listener."""
    config = route_pb2.RouteConfiguration(
        name=listener.name,
        virtual_hosts=[
            _virtual_host(
                vhost,
                listener.max_request_body_bytes,
                listener.tracing.sampling if listener.tracing is not None else None,
            )
            for vhost in listener.virtual_hosts
        ],
    )
    largest = max(
        (len(models_list_body(*vhost.adapters_listed)) for vhost in listener.virtual_hosts),
        default=0,
    )
    if largest > _DIRECT_BODY_DEFAULT_LIMIT:
        config.max_direct_response_body_size_bytes.value = largest
    return config


def _virtual_host(
    vhost: PlanVirtualHost, body_limit: int, sampling: float | None
) -> route_components_pb2.VirtualHost:
    # OpenAI clients and chat UIs list models first: Envoy answers from config, before any
    # route could send the request to a replica.
    routes: list[route_components_pb2.Route] = [_models_list_route(vhost.adapters_listed)]
    # Before the routes: a route that takes any model would otherwise take a virtual one.
    routes.extend(escalation_entries(vhost, body_limit))
    routes.extend(virtual_entries(vhost))
    for route in vhost.routes:
        routes.extend(_routes(route, vhost.model_header, body_limit, sampling))
    for route in vhost.routes:
        if route.any_model:
            # Adapter fallback 'base': any other model (an adapter no replica has loaded)
            # goes to this route's replicas, once every route's own models had their turn.
            wide = replace(route, name=route.name + "/any-model", models=())
            routes.extend(_routes(wide, vhost.model_header, body_limit, sampling))
    if vhost.routes_by_model:
        routes.append(_unknown_model_route())
    return route_components_pb2.VirtualHost(
        name=vhost.name,
        domains=list(vhost.domains),
        routes=routes,
        response_headers_to_add=response_headers(vhost),
    )


def _routes(
    route: PlanRoute, model_header: str, body_limit: int, sampling: float | None = None
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
    matches: list[tuple[route_components_pb2.RouteMatch, str | None]] = []
    if route.models:
        for name in route.models:
            matches.append((match_of(route, header=(model_header, name)), name))
            matches.append((match_of(route, model=name, unless_header=model_header), name))
    else:
        matches.append((match_of(route), None))
    # Tenants past a budget first: their entries must win over every class and affinity entry.
    yield from budget_entries(route, [(model or "", match) for match, model in matches], body_limit)
    for plan_class in route.classes or (None,):
        for index, (base, model) in enumerate(matches):
            name = f"{route.name}#{index}"
            match = base
            if plan_class is not None:
                match = with_class(base, plan_class, route.tenant_header)
                name += f"@{plan_class.name}" + ("" if selects(plan_class) else "/fallback")
                if plan_class.sheds:
                    yield restricted_entry(route, plan_class, name, match, body_limit)
            for entry in _entries(route, plan_class, name, match, body_limit):
                if route.model_subsets and model is not None:
                    # The replicas that serve the model. A body's model is in the request's
                    # envoy.lb metadata already; the override header's is not.
                    entry.route.metadata_match.filter_metadata[MODEL_METADATA_NAMESPACE].fields[
                        MODEL_METADATA_KEY
                    ].string_value = model
                if sampling is not None:
                    entry.tracing.CopyFrom(
                        entry_tracing(
                            sampling=sampling,
                            route=route.name.removesuffix("/any-model"),
                            pools=route.pools,
                            model=model or "",
                            service_class=plan_class.name if plan_class is not None else "",
                            hashed=_hashed(entry.name),
                        )
                    )
                yield entry


def _entries(
    route: PlanRoute,
    plan_class: PlanClass | None,
    name: str,
    match: route_components_pb2.RouteMatch,
    body_limit: int,
) -> Iterable[route_components_pb2.Route]:
    """The entries that serve one match: affinity first, then prompt-prefix, then plain; with
    overflow, the entry that sends a share of conversations to a paid pool goes before the
    affinity entry, the one for the other requests before the plain entry."""
    affinity = route.affinity
    entries = []
    overflow = route.overflow
    if affinity is not None and overflow is not None and overflow.sessions > 0:
        entries.append(
            overflow_entry(
                route,
                f"{name}/affinity",
                with_header(match, affinity.header),
                body_limit,
                sessions=True,
            )
        )
    if affinity is not None:
        session_entry = route_entry(
            route,
            f"{name}/affinity",
            with_header(match, affinity.header),
            affinity=affinity.header,
            body_limit=body_limit,
        )
        if overflow is not None and overflow.gate:
            # Through the gate; turned away, the session waits on its replica's twin, or
            # goes to the paid pools with the other requests.
            if overflow.gate_conversations and overflow.cluster:
                session_entry.route.cluster = gated_name(overflow.cluster)
                session_entry.route.auto_host_rewrite.value = True
                gate_retries(session_entry)
            else:
                session_entry.route.cluster = gated_name(session_entry.route.cluster)
                gate_retries(session_entry, tries=SESSION_TRIES)
        entries.append(session_entry)
        if affinity.prefix_hash_chars:
            prefix_entry = route_entry(
                route,
                f"{name}/prefix",
                with_header(match, PREFIX_KEY_HEADER),
                affinity=PREFIX_KEY_HEADER,
                body_limit=body_limit,
            )
            if overflow is not None and overflow.gate and overflow.cluster:
                # A request without a session: turned away, on to the paid pools.
                prefix_entry.route.cluster = gated_name(overflow.cluster)
                prefix_entry.route.auto_host_rewrite.value = True
                gate_retries(prefix_entry)
            entries.append(prefix_entry)
    if overflow is not None and overflow.plain > 0:
        # After the prompt-prefix entry: a request the Lua filter gives a prefix key is
        # matched again and takes that entry, so it draws once.
        entries.append(overflow_entry(route, name, match, body_limit, sessions=False))
    entry = route_entry(route, name, match, affinity=None, body_limit=body_limit)
    if overflow is not None and overflow.gate and overflow.cluster:
        # Through the gate; turned away, on to the paid pools (then the replicas).
        entry = route_entry(
            replace(
                route,
                cluster=gated_name(overflow.cluster),
                host_rewrite=True,
                tiers=max(route.tiers, overflow.members + 1),
            ),
            name,
            match,
            affinity=None,
            body_limit=body_limit,
        )
        gate_retries(entry)
    if affinity is not None and affinity.prefix_hash_chars:
        # No session header: the Lua filter derives a key from the prompt's first
        # characters and sets PREFIX_KEY_HEADER; changing headers clears Envoy's route
        # cache, so the request is matched again and takes the "/prefix" entry above.
        entry.typed_per_filter_config[LUA].CopyFrom(
            pack(
                lua_pb2.LuaPerRoute(
                    source_code=base_pb2.DataSource(
                        inline_string=prefix_key_lua(
                            affinity.header,
                            affinity.prefix_hash_chars,
                            affinity.hot_prefix_share,
                        )
                    )
                )
            )
        )
    entries.append(entry)
    if plan_class is not None:
        for out in entries:
            # Per-class stats from Envoy itself: vhost.<policy>.route.<route>.<class>.upstream_rq_*
            # counts what the class was admitted and times it (upstream_rq_time).
            out.stat_prefix = class_stat_prefix(route, plan_class) + (
                ".overflow" if out.name.endswith(OVERFLOW_SUFFIX) else ""
            )
            if plan_class.budget is not None:
                out.typed_per_filter_config[SERVICE_CLASS].CopyFrom(
                    pack(class_budget(plan_class.budget, route.tenant_header, out.stat_prefix))
                )
    return entries


def _hashed(entry: str) -> str:
    """Which hash picks the replica for a route entry, by its name (``_entries``)."""
    if entry.endswith("/affinity"):
        return "session"
    if entry.endswith("/prefix"):
        return "prefix"
    return "none"


_HOT_WINDOW = 200
"""Requests over which a prompt prefix's share is counted (the decay's time constant)."""


def prefix_key_lua(session_header: str, chars: int, hot_share: int = 0) -> str:
    """Lua run by Envoy on requests without a session header: a hash of the first ``chars``
    characters of the prompt (from the ``messages`` or ``prompt`` field on, as sent) becomes
    the PREFIX_KEY_HEADER, so requests that share a long prefix (a system prompt, a document)
    hash to the same replica and meet its prefix cache.

    The trade-off of ``chars``: too small and unrelated conversations that merely share a
    short system prompt all pile onto one replica (bounded load then spills them over); too
    large and requests sharing a long prefix still differ within the window and scatter.
    The hash is computed in Lua so the header stays short and printable whatever the prompt
    holds; Envoy then hashes the header onto the ring like a session ID.

    With ``hot_share`` (percent), a prefix that takes more than that share of the recent
    prefix-hashed requests is spread over ``ceil(share / hot_share)`` ring points: its key
    gets a suffix drawn per request, the first point being the unsuffixed key, so a cooling
    prefix falls back to the replica it always had. One popular document then loads several
    replicas as evenly as the rest of the traffic, each caching it once, instead of holding
    one replica at its bounded load. Shares are counted per Envoy worker (each Lua state has
    its own table) over about the last ``_HOT_WINDOW`` requests, and only once that many
    have been seen, so a cold start spreads nothing.
    """
    header = f"""-- kvpilot: prompt-prefix affinity key ({chars} characters)
"""
    spread = ""
    if hot_share:
        header = f"""-- kvpilot: prompt-prefix affinity key ({chars} characters), prefixes over \
{hot_share}% of requests spread
local decay = 1 - 1 / {_HOT_WINDOW}
local seen, total, requests = {{}}, 0, 0

-- The key's share of recent requests, counted with exponential decay: one request weighs
-- `decay` less with each request that follows it.
local function share(key)
  requests = requests + 1
  total = total * decay + 1
  local entry = seen[key]
  if entry == nil then
    entry = {{0, requests}}
    seen[key] = entry
  end
  entry[1] = entry[1] * decay ^ (requests - entry[2]) + 1
  entry[2] = requests
  if requests % {_HOT_WINDOW} == 0 then
    for other, e in pairs(seen) do
      if e[1] * decay ^ (requests - e[2]) < 0.05 then
        seen[other] = nil
      end
    end
  end
  if requests < {_HOT_WINDOW} then
    return 0
  end
  return entry[1] / total
end
"""
        spread = f"""  local points = math.ceil(share(key) * 100 / {hot_share} - 1e-9)
  if points > 1 then
    local point = math.random(points) - 1
    if point > 0 then
      key = key .. "-" .. point
    end
  end
"""
    return (
        header
        + f"""function envoy_on_request(handle)
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
  local key = string.format("%x", hash)
"""
        + spread
        + f"""  -- Header handles taken before body() are invalid after it yields: fetch them again.
  handle:headers():add("{PREFIX_KEY_HEADER}", key)
end
"""
    )


def _unknown_model_route() -> route_components_pb2.Route:
    """Requests for a model no route serves get OpenAI's 404, not an empty 503."""
    return _json_direct_response(
        "unknown-model",
        route_components_pb2.RouteMatch(prefix="/"),
        status=404,
        body=UNKNOWN_MODEL_BODY,
    )


def _models_list_route(
    listed: tuple[tuple[str, ...], Mapping[str, str]],
) -> route_components_pb2.Route:
    models, parents = listed
    match = route_components_pb2.RouteMatch(
        path=MODELS_PATH,
        headers=[
            route_components_pb2.HeaderMatcher(
                name=":method", string_match=string_pb2.StringMatcher(exact="GET")
            )
        ],
    )
    return _json_direct_response(
        "models", match, status=200, body=models_list_body(models, parents)
    )


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
