"""Escalation of a virtual model in Envoy: the route entry of requests sent to the small model
with escalation, and the aggregate cluster whose upstream filters rename the model on the
try that lands on the large model (``xdsserver.translate.difficulty`` has the request's
path up to here)."""

from __future__ import annotations

import json
from collections.abc import Iterable

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2 as header_mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, protocol_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.upstream_codec.v3 import upstream_codec_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import string_pb2
from google.protobuf import wrappers_pb2

from compiler.plan import PlanEscalation, PlanVirtualHost, PlanVirtualModel
from xdsserver.translate.clusters import aggregate_cluster
from xdsserver.translate.difficulty import (
    ESCALATE_HEADER,
    ESCALATED_HEADER,
    MODEL_RESPONSE_HEADER,
    lua_string,
)
from xdsserver.translate.listeners import DIFFICULTY_METADATA as METADATA_NAMESPACE
from xdsserver.translate.listeners import LUA
from xdsserver.translate.protos import HTTP_PROTOCOL_OPTIONS, duration, pack


def escalation_entries(vhost: PlanVirtualHost, body_limit: int) -> list[route_components_pb2.Route]:
    """Entries for requests a virtual model sent to its small model with escalation: to the
    aggregate of the two targets, retried once on the large one."""
    out = []
    for virtual in vhost.virtual_models:
        escalation = virtual.escalation
        if escalation is None:
            continue
        match = route_components_pb2.RouteMatch(
            prefix="/",
            headers=[
                route_components_pb2.HeaderMatcher(
                    name=vhost.model_header,
                    string_match=string_pb2.StringMatcher(exact=virtual.small),
                ),
                route_components_pb2.HeaderMatcher(
                    name=ESCALATE_HEADER,
                    string_match=string_pb2.StringMatcher(exact=virtual.key),
                ),
            ],
        )
        policy = route_components_pb2.RetryPolicy(
            retry_on=",".join(escalation.retry_on),
            num_retries=wrappers_pb2.UInt32Value(value=1),
            retry_host_predicate=[
                route_components_pb2.RetryPolicy.RetryHostPredicate(
                    name="envoy.retry_host_predicates.previous_hosts",
                    typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()),
                )
            ],
            # The aggregate lays the small model's priorities before the large one's: moving
            # past the priority that failed is moving to the large model (the small model's
            # route has one tier, which validation holds).
            retry_priority=route_components_pb2.RetryPolicy.RetryPriority(
                name="envoy.retry_priorities.previous_priorities",
                typed_config=pack(
                    previous_priorities_config_pb2.PreviousPrioritiesConfig(update_frequency=1)
                ),
            ),
        )
        if escalation.per_try_timeout:
            policy.per_try_timeout.CopyFrom(duration(escalation.per_try_timeout))
        entry = route_components_pb2.Route(
            name=f"{virtual.key}#escalate",
            match=match,
            route=route_components_pb2.RouteAction(
                cluster=escalation.cluster,
                timeout=duration(escalation.timeout),
                idle_timeout=duration(escalation.idle_timeout),
                retry_policy=policy,
            ),
        )
        # The router keeps the body to send it again.
        entry.request_body_buffer_limit.value = body_limit
        out.append(entry)
    return out


UPSTREAM_HOST_HEADER = "x-kvpilot-upstream-host"
"""Set on each try by the escalation aggregate's header mutation: the host Envoy picked."""


def escalation_lua(virtual: PlanVirtualModel, escalation: PlanEscalation) -> str:
    """Upstream Lua of the escalation aggregate, run on every try: a try that lands on the
    large model's host (the retry, or every try while the small model's pools are down)
    carries the large model's name in the body, and its answer says it was escalated. The
    host comes from the header mutation before it (Envoy knows the host in upstream filters,
    and the aggregate's own name is all ``%UPSTREAM_CLUSTER%`` gives)."""
    hosts = ", ".join(f"[{lua_string(host)}] = true" for host in escalation.large_hosts)
    return f"""-- kvpilot: escalation of virtual model {virtual.name}
local LARGE_HOSTS = {{{hosts}}}

function envoy_on_request(handle)
  local headers = handle:headers()
  local host = headers:get("{UPSTREAM_HOST_HEADER}")
  headers:remove("{UPSTREAM_HOST_HEADER}")
  if host == nil or not LARGE_HOSTS[host] then
    return
  end
  local body = handle:body()
  if body ~= nil then
    local text = body:getBytes(0, body:length())
    local rewritten = string.gsub(text, '"model"%s*:%s*"[^"]*"', function()
      return '"model":' .. {lua_string(json.dumps(virtual.large))}
    end, 1)
    handle:body():setBytes(rewritten)
  end
  handle:streamInfo():dynamicMetadata():set("{METADATA_NAMESPACE}", "escalated", "true")
end

function envoy_on_response(handle)
  local metadata = handle:streamInfo():dynamicMetadata():get("{METADATA_NAMESPACE}")
  if metadata ~= nil and metadata["escalated"] == "true" then
    handle:headers():replace("{MODEL_RESPONSE_HEADER}", {lua_string(virtual.large)})
    handle:headers():replace("{ESCALATED_HEADER}", "true")
  end
end
"""


def escalation_clusters(vhosts: Iterable[PlanVirtualHost]) -> list[cluster_pb2.Cluster]:
    """One aggregate per escalating virtual model: its small then its large route cluster,
    with the upstream Lua that renames the model on the retry."""
    out = []
    for vhost in vhosts:
        for virtual in vhost.virtual_models:
            escalation = virtual.escalation
            if escalation is None:
                continue
            out.append(_escalation_cluster(virtual, escalation))
    return out


def _escalation_cluster(
    virtual: PlanVirtualModel, escalation: PlanEscalation
) -> cluster_pb2.Cluster:
    aggregate = aggregate_cluster(escalation.cluster, escalation.members, 5)
    options = http_protocol_options_pb2.HttpProtocolOptions()
    if escalation.protocol == "http2":
        options.explicit_http_config.http2_protocol_options.CopyFrom(
            protocol_pb2.Http2ProtocolOptions()
        )
    else:
        options.explicit_http_config.http_protocol_options.CopyFrom(
            protocol_pb2.Http1ProtocolOptions()
        )
    # Upstream filters run per try, so the retry can carry another model name.
    options.http_filters.append(
        hcm_pb2.HttpFilter(
            name="envoy.filters.http.header_mutation",
            typed_config=pack(
                header_mutation_pb2.HeaderMutation(
                    mutations=header_mutation_pb2.Mutations(
                        request_mutations=[
                            header_mutation_rules_pb2.HeaderMutation(
                                append=base_pb2.HeaderValueOption(
                                    header=base_pb2.HeaderValue(
                                        key=UPSTREAM_HOST_HEADER, value="%UPSTREAM_HOST%"
                                    ),
                                    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                                )
                            )
                        ]
                    )
                )
            ),
        )
    )
    options.http_filters.append(
        hcm_pb2.HttpFilter(
            name=LUA,
            typed_config=pack(
                lua_pb2.Lua(
                    default_source_code=base_pb2.DataSource(
                        inline_string=escalation_lua(virtual, escalation)
                    )
                )
            ),
        )
    )
    options.http_filters.append(
        hcm_pb2.HttpFilter(
            name="envoy.filters.http.upstream_codec",
            typed_config=pack(upstream_codec_pb2.UpstreamCodec()),
        )
    )
    aggregate.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(pack(options))
    return aggregate
