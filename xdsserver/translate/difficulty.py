"""Virtual models in Envoy: the route entries that take a virtual model's requests, the Lua that
scores each one and picks its target, the classifier's cluster and the log that reports scores.

How a request to a virtual model travels (no Python in its path):

1. ``json_to_metadata`` copies the body's ``model`` to metadata; the virtual model's entry
   matches it (or the model override header) and carries the Lua below per route.
2. The Lua reads the body, takes a score (client header, built-in features or the operator's
   classifier over ``httpCall`` with a timeout), compares it with the threshold kvpilot keeps
   (``policies.difficultyshare``), holds the worker's cap and floor, and rewrites the body's
   ``model`` to the target. It sets the model override header to the target: changing a
   header clears Envoy's route cache, so the request is matched again and takes the target's
   own route entry, with its pools, retries and affinity.
3. The score and target go to dynamic metadata (namespace ``kvpilot.difficulty``): the virtual
   host names the answering model in a response header from there, and a gRPC access log
   with a metadata filter reports one entry per scored request to kvpilot.

The entry itself answers 503 directly: it only runs if the Lua failed to pick a target, and
then the client learns so instead of a target receiving a model name it does not serve.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2 as header_mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.upstream_codec.v3 import upstream_codec_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import previous_priorities_config_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2
from envoy.type.matcher.v3 import value_pb2 as value_matcher_pb2
from google.protobuf import wrappers_pb2

from compiler.plan import PlanEscalation, PlanVirtualHost, PlanVirtualModel
from policies.difficulty import COUNT_LIMIT, EFFORTS, MATH_WORDS, QUESTION_WORDS, WINDOW
from policies.difficultyshare import GUARD_WARMUP, GUARD_WINDOW
from policies.models.difficulty import FEATURES
from xdsserver.translate.listeners import DIFFICULTY_METADATA as METADATA_NAMESPACE
from xdsserver.translate.listeners import LUA
from xdsserver.translate.protos import HTTP_PROTOCOL_OPTIONS, duration, pack, socket_address

MODEL_RESPONSE_HEADER = "x-kvpilot-model"
"""Response header naming the model that answered a virtual model's request."""
SCORE_RESPONSE_HEADER = "x-kvpilot-difficulty-score"
ESCALATE_HEADER = "x-kvpilot-escalate"
"""Set by the Lua on requests it sends to a small model that escalates (the virtual model's
key), so they take the escalation entry; a client's own value is removed."""
ESCALATED_HEADER = "x-kvpilot-escalated"
"""Response header of a request the large model answered after the small one failed."""
UNSCORED_BODY = json.dumps(
    {
        "error": {
            "message": "This virtual model could not choose a target model.",
            "type": "server_error",
            "param": "model",
            "code": "virtual_model_failed",
        }
    }
)


def virtual_entries(vhost: PlanVirtualHost) -> list[route_components_pb2.Route]:
    """Route entries of the virtual models: the override header's match, then the body's."""
    out = []
    for virtual in vhost.virtual_models:
        code = lua_source(virtual, vhost.model_header)
        for suffix, match in _matches(virtual.name, vhost.model_header):
            entry = route_components_pb2.Route(
                name=f"{virtual.key}#virtual{suffix}",
                match=match,
                direct_response=route_components_pb2.DirectResponseAction(
                    status=503, body=base_pb2.DataSource(inline_string=UNSCORED_BODY)
                ),
            )
            entry.typed_per_filter_config[LUA].CopyFrom(
                pack(lua_pb2.LuaPerRoute(source_code=base_pb2.DataSource(inline_string=code)))
            )
            out.append(entry)
    return out


def _matches(model: str, model_header: str) -> list[tuple[str, route_components_pb2.RouteMatch]]:
    header = route_components_pb2.RouteMatch(
        prefix="/",
        headers=[
            route_components_pb2.HeaderMatcher(
                name=model_header, string_match=string_pb2.StringMatcher(exact=model)
            )
        ],
    )
    body = route_components_pb2.RouteMatch(
        prefix="/",
        headers=[
            route_components_pb2.HeaderMatcher(
                name=model_header, present_match=True, invert_match=True
            )
        ],
        dynamic_metadata=[
            metadata_pb2.MetadataMatcher(
                filter="envoy.lb",
                path=[metadata_pb2.MetadataMatcher.PathSegment(key="model")],
                value=value_matcher_pb2.ValueMatcher(
                    string_match=string_pb2.StringMatcher(exact=model)
                ),
            )
        ],
    )
    return [("/header", header), ("/body", body)]


def response_headers(vhost: PlanVirtualHost) -> list[base_pb2.HeaderValueOption]:
    """The answering model and the score, from the metadata the Lua wrote. Envoy leaves a
    header out when its value comes out empty, so other requests get neither."""
    if not vhost.virtual_models:
        return []
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(
                key=name, value=f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{key})%"
            ),
            # An escalated answer names the large model from the upstream filter; keep it.
            append_action=base_pb2.HeaderValueOption.ADD_IF_ABSENT,
        )
        for name, key in ((MODEL_RESPONSE_HEADER, "target"), (SCORE_RESPONSE_HEADER, "score"))
    ]


def scorer_clusters(vhosts: Iterable[PlanVirtualHost]) -> list[cluster_pb2.Cluster]:
    """One cluster per external classifier, resolved by Envoy (a name or an address)."""
    out = []
    for vhost in vhosts:
        for virtual in vhost.virtual_models:
            service = virtual.service
            if service is None:
                continue
            name = service.cluster
            out.append(
                cluster_pb2.Cluster(
                    name=name,
                    type=cluster_pb2.Cluster.STRICT_DNS,
                    connect_timeout=duration(service.timeout),
                    load_assignment=endpoint_pb2.ClusterLoadAssignment(
                        cluster_name=name,
                        endpoints=[
                            endpoint_components_pb2.LocalityLbEndpoints(
                                lb_endpoints=[
                                    endpoint_components_pb2.LbEndpoint(
                                        endpoint=endpoint_components_pb2.Endpoint(
                                            address=socket_address(service.host, service.port)
                                        )
                                    )
                                ]
                            )
                        ],
                    ),
                )
            )
    return out


def _lua_string(value: str) -> str:
    """A Lua string literal (JSON's escapes are a subset Lua reads the same way, for ASCII)."""
    return json.dumps(value, ensure_ascii=True)


def _lua_list(words: Iterable[str]) -> str:
    return "{" + ", ".join(_lua_string(word) for word in words) + "}"


def lua_source(virtual: PlanVirtualModel, model_header: str) -> str:
    """The Lua that scores one virtual model's requests and picks their target.

    Its feature arithmetic is ``policies.difficulty.features``, term for term, and its cap and
    floor are ``policies.difficultyshare.ShareGuard``; tests hold the two in step.
    """
    weights = dict(virtual.weights)
    terms = " + ".join(f"{weights.get(name, 0.0)!r} * f.{name}" for name in FEATURES)
    service = virtual.service
    if virtual.scorer == "builtin":
        scoring = '    score = builtin(text)\n    source = "builtin"\n'
    elif virtual.scorer == "external" and service is not None:
        scoring = f"""    local answer_headers, answer = handle:httpCall(
      {_lua_string(service.cluster)},
      {{[":method"] = "POST", [":path"] = {_lua_string(service.path)},
       [":authority"] = {_lua_string(service.host)}, ["content-type"] = "application/json"}},
      text, {max(1, round(service.timeout * 1000))})
    if answer_headers ~= nil and answer_headers[":status"] == "200" and answer ~= nil then
      score = tonumber(string.match(answer, '"score"%s*:%s*([-%d%.eE+]+)'))
    end
    if score ~= nil and score == score then
      score = math.max(0, math.min(1, score))
      source = "external"
    else
      score = nil
    end
"""
    else:
        scoring = '    score = 0\n    source = "header"\n'
    fallback_large = "true" if service is not None and service.fallback_large else "false"
    return f"""-- kvpilot: virtual model {virtual.name} ({virtual.scorer} scorer)
local SMALL, LARGE = {_lua_string(virtual.small)}, {_lua_string(virtual.large)}
local SMALL_JSON, LARGE_JSON = {_lua_string(json.dumps(virtual.small))}, {_lua_string(json.dumps(virtual.large))}
local THRESHOLD, TIE = {virtual.threshold!r}, {virtual.tie!r}
local CAP, FLOOR = {virtual.cap / 100!r}, {virtual.floor / 100!r}
local ESCALATES = {"true" if virtual.escalation is not None else "false"}
local decay = 1 - 1 / {GUARD_WINDOW}
local large_weight, total_weight, seen = 0, 0, 0
local EFFORTS = {{low = {EFFORTS["low"]}, medium = {EFFORTS["medium"]}, high = {EFFORTS["high"]}}}
local MATH_WORDS = {_lua_list(MATH_WORDS)}
local QUESTION_WORDS = {_lua_list(QUESTION_WORDS)}

local function count(text, word)
  local n, at = 0, 1
  while true do
    local s, e = string.find(text, word, at, true)
    if s == nil then
      return n
    end
    n, at = n + 1, e + 1
  end
end

local function count_all(text, words)
  local n = 0
  for _, word in ipairs(words) do
    n = n + count(text, word)
  end
  return n
end

local function builtin(text)
  local head = string.sub(text, 1, {WINDOW})
  local lower = string.lower(head)
  local f = {{}}
  f.promptTokens = math.log(1 + #text / 4)
  f.turns = math.min(count(head, '"role"'), {COUNT_LIMIT})
  f.codeBlocks = math.min(math.floor(count(head, "```") / 2), {COUNT_LIMIT})
  f.math = math.min(count(head, "=") + count_all(lower, MATH_WORDS), {COUNT_LIMIT})
  f.questionWords = math.min(count_all(lower, QUESTION_WORDS), {COUNT_LIMIT})
  local tokens = string.match(head, '"max_tokens"%s*:%s*(%d+)')
    or string.match(head, '"max_completion_tokens"%s*:%s*(%d+)')
  f.maxTokens = tokens and math.log(1 + math.min(tonumber(tokens), 1000000)) or 0
  local effort = string.match(head, '"reasoning_effort"%s*:%s*"(%a+)"')
  f.reasoningEffort = effort and (EFFORTS[string.lower(effort)] or 0) or 0
  local z = {virtual.bias!r} + {terms}
  if z >= 0 then
    return 1 / (1 + math.exp(-z))
  end
  local e = math.exp(z)
  return e / (1 + e)
end

local function stated(value)
  if value == nil then
    return nil
  end
  value = string.lower(value)
  if value == "hard" then
    return 1
  elseif value == "easy" then
    return 0
  end
  local number = tonumber(value)
  if number == nil or number ~= number then
    return nil
  end
  return math.max(0, math.min(1, number))
end

function envoy_on_request(handle)
  local score = stated(handle:headers():get({_lua_string(virtual.header)}))
  local source = "header"
  local body = handle:body()
  local text = ""
  if body ~= nil then
    text = body:getBytes(0, body:length())
  end
  if score == nil then
{scoring}  end
  local large
  if score == nil then
    large = {fallback_large}
    source = "fallback"
  else
    large = score > THRESHOLD or (score == THRESHOLD and math.random() < TIE)
  end
  -- Cap and floor over this worker's recent requests, whatever the scorer said.
  seen = seen + 1
  local total = total_weight * decay + 1
  local forced = ""
  if large and (large_weight * decay + 1) / total > CAP then
    large, forced = false, "cap"
  elseif not large and seen > {GUARD_WARMUP} and large_weight * decay / total < FLOOR then
    large, forced = true, "floor"
  end
  large_weight = large_weight * decay + (large and 1 or 0)
  total_weight = total
  local target = large and LARGE or SMALL
  -- Handles taken before a yield (body(), httpCall) are invalid after it: fetch them again.
  local rewritten = string.gsub(text, '"model"%s*:%s*"[^"]*"', function()
    return '"model":' .. (large and LARGE_JSON or SMALL_JSON)
  end, 1)
  if body ~= nil then
    handle:body():setBytes(rewritten)
  end
  local metadata = handle:streamInfo():dynamicMetadata()
  metadata:set("{METADATA_NAMESPACE}", "virtual", {_lua_string(virtual.key)})
  metadata:set("{METADATA_NAMESPACE}", "target", target)
  if score ~= nil then
    metadata:set("{METADATA_NAMESPACE}", "score", string.format("%.4f", score))
  end
  metadata:set("{METADATA_NAMESPACE}", "source", source)
  metadata:set("{METADATA_NAMESPACE}", "forced", forced)
  local out = handle:headers()
  out:remove("{ESCALATE_HEADER}")
  if ESCALATES and not large then
    out:replace("{ESCALATE_HEADER}", {_lua_string(virtual.key)})
  end
  out:replace({_lua_string(model_header)}, target)
end
"""


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
    hosts = ", ".join(f"[{_lua_string(host)}] = true" for host in escalation.large_hosts)
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
      return '"model":' .. {_lua_string(json.dumps(virtual.large))}
    end, 1)
    handle:body():setBytes(rewritten)
  end
  handle:streamInfo():dynamicMetadata():set("{METADATA_NAMESPACE}", "escalated", "true")
end

function envoy_on_response(handle)
  local metadata = handle:streamInfo():dynamicMetadata():get("{METADATA_NAMESPACE}")
  if metadata ~= nil and metadata["escalated"] == "true" then
    handle:headers():replace("{MODEL_RESPONSE_HEADER}", {_lua_string(virtual.large)})
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
    aggregate = cluster_pb2.Cluster(
        name=escalation.cluster,
        connect_timeout=duration(5),
        lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
    )
    aggregate.cluster_type.name = "envoy.clusters.aggregate"
    aggregate.cluster_type.typed_config.CopyFrom(
        pack(aggregate_pb2.ClusterConfig(clusters=list(escalation.members)))
    )
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
