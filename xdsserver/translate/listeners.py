"""LDS: one plain-HTTP listener per port, with the HTTP filters its routes need."""

from __future__ import annotations

from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import (
    base_pb2,
    config_source_pb2,
    grpc_service_pb2,
    substitution_format_string_pb2,
)
from envoy.config.listener.v3 import listener_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as accesslog_data_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.type.matcher.v3 import metadata_pb2
from envoy.type.matcher.v3 import regex_pb2 as regex_matcher_pb2
from envoy.type.matcher.v3 import value_pb2 as value_matcher_pb2
from google.protobuf import struct_pb2, wrappers_pb2

from compiler.plan import PlanListener
from xdsserver.translate.metadata import (
    MODEL_METADATA_KEY,
    MODEL_METADATA_NAMESPACE,
    pool_tag,
)
from xdsserver.translate.protos import ads_source, duration, http_filter_chain, pack, socket_address
from xdsserver.translate.tracing import listener_tracing
from xdsserver.translate.usage import usage_filter, usage_log

LOCAL_RATELIMIT = "envoy.filters.http.local_ratelimit"
SIGNALS_CLUSTER = "kvpilot_signals"
"""The bootstrap cluster that reaches kvpilot's access log service (deploy/envoy/)."""
SIGNALS_FLUSH_INTERVAL = 0.25
"""Seconds Envoy buffers access log entries before sending them (its default is 1 s)."""
RETRY_AFTER = "retry-after"
LUA = "envoy.filters.http.lua"
DIFFICULTY_METADATA = "kvpilot.difficulty"
"""Dynamic metadata a virtual model's Lua writes (``xdsserver.translate.difficulty``):
``virtual`` (policy/name), ``target``, ``score``, ``source`` (header, builtin, external or
fallback), ``forced`` (cap or floor)."""
DIFFICULTY_LOG = "kvpilot-difficulty"
ARRIVALS_LOG = "kvpilot-arrivals"
"""Log name prefix of the router's arrivals log (``xdsserver.arrivals``): ``<prefix>/<listener>``."""
"""``log_name`` prefix of the access log that reports scores (``xdsserver.difficultylog``)."""
SERVICE_CLASS = "kvpilot.service_class"
"""A second local rate limit filter, for service classes: class budgets with tenant shares,
and the counter of shed requests. Apart from routes' own rate limits, so both can apply."""
SHED_STATUS = 529
"""The status of Envoy's direct response to a shed request; the local-reply mapper answers
the client 429 with SHED_BODY instead. A status of its own keeps shed replies apart from
rate-limit 429s, whose mapper would otherwise take them."""
SHED_BODY = {
    "error": {
        "message": "%LOCAL_REPLY_BODY%",
        "type": "rate_limit_exceeded",
        "param": None,
        "code": "overloaded",
    }
}
"""A shed request's answer in OpenAI's error format: the message names the class and the
Retry-After, and the code tells it apart from a rate limit."""
BUDGET_STATUS = 531
"""The status of Envoy's direct response to a request past its budget; the local-reply
mapper answers the client 429 with BUDGET_BODY. A status of its own keeps these apart from
rate limits and shed requests."""
BUDGET_RESET_HEADER = "x-kvpilot-budget-reset"
"""Unix time the budget's window ends; the accounting filter (``xdsserver.translate.usage``) turns it into Retry-After
seconds on the way out."""
BUDGET_BODY = {
    "error": {
        "message": "%LOCAL_REPLY_BODY%",
        "type": "insufficient_quota",
        "param": None,
        "code": "budget_exceeded",
    }
}


RATE_LIMITED_BODY = {
    "error": {
        "message": "Rate limit reached for this route; retry after the interval in the "
        "x-ratelimit-reset header.",
        "type": "rate_limit_exceeded",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}

UNAVAILABLE_BODY = {
    "error": {
        "message": "%LOCAL_REPLY_BODY%",
        "type": "server_error",
        "param": None,
        "code": "%RESPONSE_CODE_DETAILS%",
    }
}
"""Envoy's own 5xx answers (no healthy replica, circuit breaker overflow, upstream timeout or
reset) in OpenAI's error format. Envoy fills in its message and the reason in snake case,
for example ``no_healthy_upstream`` or ``upstream_reset_before_response_started{overflow}``."""


def translate_listener(listener: PlanListener) -> listener_pb2.Listener:
    """A plain-HTTP listener whose routes come over RDS (route configuration of the same name)."""
    # Token accounting first: on the way back it sees the response last, as the client does.
    filters: list[hcm_pb2.HttpFilter] = [usage_filter()]
    if listener.routes_by_model:
        filters.append(
            hcm_pb2.HttpFilter(
                name="envoy.filters.http.json_to_metadata",
                typed_config=pack(_model_to_metadata()),
            )
        )
    if listener.rate_limited:
        # Off at the listener; routes with a rate limit turn it on in typed_per_filter_config.
        filters.append(
            hcm_pb2.HttpFilter(
                name=LOCAL_RATELIMIT,
                typed_config=pack(local_rate_limit_pb2.LocalRateLimit(stat_prefix="rate_limit")),
            )
        )
    if listener.classified:
        # Off at the listener; class budgets and shed counters are set per route entry.
        filters.insert(
            len(filters) - (1 if listener.rate_limited else 0),
            hcm_pb2.HttpFilter(
                name=SERVICE_CLASS,
                typed_config=pack(local_rate_limit_pb2.LocalRateLimit(stat_prefix="service_class")),
            ),
        )
    if listener.prefix_hashing or listener.virtual_models:
        # No code at the listener; routes with prompt-prefix affinity and virtual models
        # bring theirs.
        filters.append(hcm_pb2.HttpFilter(name=LUA, typed_config=pack(lua_pb2.Lua())))
    router = router_pb2.Router()
    if listener.upstream_signals:
        signal_log = upstream_signal_log(listener.name, retry_after=listener.overflows)
        if listener.arrivals_log:
            # The flush below applies to every upstream log of the router: rollouts and
            # overflow read finished attempts only.
            signal_log.filter.log_type_filter.types.append(accesslog_data_pb2.UpstreamPoolReady)
            signal_log.filter.log_type_filter.exclude = True
        router.upstream_log.append(signal_log)
    if listener.arrivals_log:
        # One entry when an attempt gets its upstream stream (cluster and host chosen), one
        # when it ends: arrival rates and service times for the spill loop.
        router.upstream_log_options.flush_upstream_log_on_upstream_stream = True
        router.upstream_log.append(arrivals_log(listener.name))
    filters.append(hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=pack(router)))
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=listener.name,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=ads_source(), route_config_name=listener.name),
        http_filters=filters,
        # Streams may stay silent while a long prompt is prefilled; the per-route idle
        # timeout governs instead.
        stream_idle_timeout=duration(0),
        drain_timeout=duration(listener.drain_timeout),
    )
    if listener.tracing is not None:
        manager.tracing.CopyFrom(listener_tracing(listener.tracing, listener.tenant_headers))
    manager.local_reply_config.CopyFrom(
        local_replies(rate_limited=listener.rate_limited, classified=listener.classified)
    )
    if listener.virtual_models:
        manager.access_log.append(score_log(listener.name))
    manager.access_log.append(usage_log(listener.name, listener.tenant_headers))
    if listener.access_log:
        manager.access_log.append(
            accesslog_pb2.AccessLog(
                name="envoy.access_loggers.stdout",
                typed_config=pack(stream_pb2.StdoutAccessLog()),
            )
        )
    return listener_pb2.Listener(
        name=listener.name,
        address=socket_address(listener.address, listener.port),
        # json_to_metadata buffers the body under the route matched before the model is
        # known: the unknown-model direct response when the model is in the body alone. A
        # route's request_body_buffer_limit does not apply to a direct response, so without
        # this the connection's 1 MiB default answers long prompts with 413.
        per_connection_buffer_limit_bytes=wrappers_pb2.UInt32Value(
            value=min(listener.max_request_body_bytes, 2**32 - 1)
        ),
        filter_chains=[http_filter_chain(manager)],
    )


def upstream_signal_log(log_name: str, *, retry_after: bool = False) -> accesslog_pb2.AccessLog:
    """The router's upstream log to kvpilot's access log service (``xdsserver.signals``).

    An upstream log, not the listener's: it has one entry per attempt, so a canary's 500 that
    a retry hid from the client still counts against the canary, and its timings are the
    attempt's own. The bootstraps define the ``kvpilot_signals`` cluster. With `retry_after`
    each entry carries the upstream's ``Retry-After``: how long a paid pool that answered
    429 wants to rest (overflow, ``signals.overflow``).
    """
    config = als_pb2.HttpGrpcAccessLogConfig(
        common_config=als_pb2.CommonGrpcAccessLogConfig(
            log_name=log_name,
            transport_api_version=config_source_pb2.V3,
            grpc_service=grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=SIGNALS_CLUSTER)
            ),
            buffer_flush_interval=duration(SIGNALS_FLUSH_INTERVAL),
        ),
    )
    if retry_after:
        config.additional_response_headers_to_log.append(RETRY_AFTER)
        # The pool of the host that answered: a provider's address is a DNS name, and behind
        # an aggregate the logged cluster need not be the provider's own.
        config.common_config.custom_tags.append(pool_tag())
    return accesslog_pb2.AccessLog(name="envoy.access_loggers.http_grpc", typed_config=pack(config))


def arrivals_log(listener_name: str) -> accesslog_pb2.AccessLog:
    """The router's arrivals log to kvpilot's access log service (``xdsserver.arrivals``):
    every attempt's start and end, with its cluster, host and timings, nothing else."""
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc",
        typed_config=pack(
            als_pb2.HttpGrpcAccessLogConfig(
                common_config=als_pb2.CommonGrpcAccessLogConfig(
                    log_name=f"{ARRIVALS_LOG}/{listener_name}",
                    transport_api_version=config_source_pb2.V3,
                    grpc_service=grpc_service_pb2.GrpcService(
                        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                            cluster_name=SIGNALS_CLUSTER
                        )
                    ),
                    buffer_flush_interval=duration(SIGNALS_FLUSH_INTERVAL),
                ),
            )
        ),
    )


def score_log(listener_name: str) -> accesslog_pb2.AccessLog:
    """One entry per request that a virtual model scored, to kvpilot's access log service."""
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=accesslog_pb2.AccessLogFilter(
            metadata_filter=accesslog_pb2.MetadataFilter(
                matcher=metadata_pb2.MetadataMatcher(
                    filter=DIFFICULTY_METADATA,
                    path=[metadata_pb2.MetadataMatcher.PathSegment(key="virtual")],
                    value=value_matcher_pb2.ValueMatcher(present_match=True),
                ),
            )
        ),
        typed_config=pack(
            als_pb2.HttpGrpcAccessLogConfig(
                additional_response_headers_to_log=["x-kvpilot-escalated"],
                common_config=als_pb2.CommonGrpcAccessLogConfig(
                    log_name=f"{DIFFICULTY_LOG}/{listener_name}",
                    transport_api_version=config_source_pb2.V3,
                    grpc_service=grpc_service_pb2.GrpcService(
                        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                            cluster_name=SIGNALS_CLUSTER
                        )
                    ),
                    buffer_flush_interval=duration(SIGNALS_FLUSH_INTERVAL),
                ),
            )
        ),
    )


JSON_CONTENT_TYPE = r"(?i)application/json[ \t]*(;.*)?"
"""Every spelling of a JSON body's media type: type and subtype are case-insensitive and
parameters (``charset=UTF-8``) come after ``;`` with any spacing (RFC 9110, 8.3.1). Matched by
RE2 against the whole header value."""


def _model_to_metadata() -> json_to_metadata_pb2.JsonToMetadata:
    """Copy the OpenAI ``model`` body field to dynamic metadata; the filter then clears the
    route cache so routes can match on it. A request whose content type the filter does not
    take skips it and misses its model route: hence one matcher for every spelling of JSON,
    and no content type at all (design.md)."""
    rule = json_to_metadata_pb2.JsonToMetadata.Rule(
        selectors=[json_to_metadata_pb2.JsonToMetadata.Selector(key=MODEL_METADATA_KEY)],
        on_present=json_to_metadata_pb2.JsonToMetadata.KeyValuePair(
            metadata_namespace=MODEL_METADATA_NAMESPACE,
            key=MODEL_METADATA_KEY,
            type=json_to_metadata_pb2.JsonToMetadata.STRING,
        ),
    )
    return json_to_metadata_pb2.JsonToMetadata(
        request_rules=json_to_metadata_pb2.JsonToMetadata.MatchRules(
            rules=[rule],
            allow_content_types_regex=regex_matcher_pb2.RegexMatcher(regex=JSON_CONTENT_TYPE),
            allow_empty_content_type=True,
        )
    )


def local_replies(*, rate_limited: bool, classified: bool = False) -> hcm_pb2.LocalReplyConfig:
    """Envoy's own error answers in OpenAI's format, so clients parse them like the model
    server's: shed requests of service classes (429), 429s from rate limits and class budgets
    (when the listener has any) and 5xx. Mappers see local replies only, so 429s and 5xx that
    replicas send pass through untouched; the first mapper that matches applies."""
    # Budget replies have a status of their own; every listener maps it, since a budget may
    # be spent at any time and the listener should not change then.
    budget = _status_mapper(accesslog_pb2.ComparisonFilter.EQ, BUDGET_STATUS, "budget", BUDGET_BODY)
    budget.status_code.value = 429
    mappers = [budget]
    if classified:
        shed = _status_mapper(accesslog_pb2.ComparisonFilter.EQ, SHED_STATUS, "shed", SHED_BODY)
        shed.status_code.value = 429
        mappers.append(shed)
    if rate_limited or classified:
        mappers.append(
            _status_mapper(
                accesslog_pb2.ComparisonFilter.EQ, 429, "rate_limited", RATE_LIMITED_BODY
            )
        )
    mappers.append(
        _status_mapper(accesslog_pb2.ComparisonFilter.GE, 500, "server_error", UNAVAILABLE_BODY)
    )
    return hcm_pb2.LocalReplyConfig(mappers=mappers)


def _status_mapper(
    op: accesslog_pb2.ComparisonFilter.Op.ValueType,
    status: int,
    runtime_name: str,
    body: dict[str, Any],
) -> hcm_pb2.ResponseMapper:
    """Replace the body of local replies whose status compares ``op`` to ``status``."""
    fields = struct_pb2.Struct()
    fields.update(body)
    return hcm_pb2.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(
            status_code_filter=accesslog_pb2.StatusCodeFilter(
                comparison=accesslog_pb2.ComparisonFilter(
                    op=op,
                    value=base_pb2.RuntimeUInt32(
                        default_value=status, runtime_key=f"kvpilot.{runtime_name}_status"
                    ),
                )
            )
        ),
        body_format_override=substitution_format_string_pb2.SubstitutionFormatString(
            json_format=fields
        ),
    )
