"""Virtual models in Envoy: the route entries that take a virtual model's requests, the Lua that
scores each one and picks its target, the classifier's cluster and the log that reports scores.

How a request to a virtual model travels (no Python in its path):

1. ``json_to_metadata`` copies the body's ``model`` to metadata; the virtual model's entry
   matches it (or the model override header) and carries the Lua below per route.
2. The Lua reads the body, takes a score (client header, built-in features or the operator's
   classifier over ``httpCall`` with a timeout), compares it with the threshold kvpilot keeps
   (``signals.difficultyshare``), holds the worker's cap and floor, and rewrites the body's
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
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2
from envoy.type.matcher.v3 import value_pb2 as value_matcher_pb2

from compiler.plan import PlanVirtualHost, PlanVirtualModel
from policies.models.difficulty import FEATURES
from signals.difficulty import COUNT_LIMIT, EFFORTS, MATH_WORDS, QUESTION_WORDS, WINDOW
from signals.difficultyshare import GUARD_WARMUP, GUARD_WINDOW
from xdsserver.translate.listeners import DIFFICULTY_METADATA as METADATA_NAMESPACE
from xdsserver.translate.listeners import LUA
from xdsserver.translate.protos import duration, pack, socket_address

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


def lua_string(value: str) -> str:
    """A Lua string literal (JSON's escapes are a subset Lua reads the same way, for ASCII)."""
    return json.dumps(value, ensure_ascii=True)


def _lua_list(words: Iterable[str]) -> str:
    return "{" + ", ".join(lua_string(word) for word in words) + "}"


def _choose(virtual: PlanVirtualModel, fallback_large: str) -> tuple[str, str]:
    """The Lua that picks the target from the score and holds the cap and floor (it sets
    ``target``), and the expression of the target's JSON string."""
    if not virtual.steps:
        return (
            f"""  local large
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
""",
            "(large and LARGE_JSON or SMALL_JSON)",
        )
    # One draw for every threshold: a score tied at several of them passes each with its own
    # probability, so each target's share comes out as kvpilot computed it.
    return (
        f"""  local large, step = false, nil
  if score == nil then
    large = {fallback_large}
    source = "fallback"
  else
    local draw = math.random()
    large = score > THRESHOLD or (score == THRESHOLD and draw < TIE)
    if not large then
      for i = #STEPS, 1, -1 do
        local s = STEPS[i]
        if score > s.threshold or (score == s.threshold and draw < s.tie) then
          step = s
          break
        end
      end
    end
  end
  -- Cap and floor over this worker's recent requests, of every target after the first.
  local above = large or step ~= nil
  seen = seen + 1
  local total = total_weight * decay + 1
  local forced = ""
  if above and (large_weight * decay + 1) / total > CAP then
    above, large, step, forced = false, false, nil, "cap"
  elseif not above and seen > {GUARD_WARMUP} and large_weight * decay / total < FLOOR then
    above, step, forced = true, STEPS[1], "floor"
  end
  large_weight = large_weight * decay + (above and 1 or 0)
  total_weight = total
  local target = large and LARGE or (step ~= nil and step.model or SMALL)
""",
        "(large and LARGE_JSON or (step ~= nil and step.json or SMALL_JSON))",
    )


def _steps(virtual: PlanVirtualModel) -> str:
    """The targets between the first and the last, as a Lua table (none with two targets)."""
    if not virtual.steps:
        return ""
    rows = "".join(
        f"  {{model = {lua_string(step.model)}, json = {lua_string(json.dumps(step.model))}, "
        f"threshold = {step.threshold!r}, tie = {step.tie!r}}},\n"
        for step in virtual.steps
    )
    return (
        f"-- Targets between the first and the last, easiest first.\nlocal STEPS = {{\n{rows}}}\n"
    )


def lua_source(virtual: PlanVirtualModel, model_header: str) -> str:
    """The Lua that scores one virtual model's requests and picks their target.

    Its feature arithmetic is ``signals.difficulty.features``, term for term, and its cap and
    floor are ``signals.difficultyshare.ShareGuard``; tests hold the two in step.
    """
    weights = dict(virtual.weights)
    terms = " + ".join(f"{weights.get(name, 0.0)!r} * f.{name}" for name in FEATURES)
    service = virtual.service
    if virtual.scorer == "builtin":
        scoring = '    score = builtin(text)\n    source = "builtin"\n'
    elif virtual.scorer == "external" and service is not None:
        scoring = f"""    local answer_headers, answer = handle:httpCall(
      {lua_string(service.cluster)},
      {{[":method"] = "POST", [":path"] = {lua_string(service.path)},
       [":authority"] = {lua_string(service.host)}, ["content-type"] = "application/json"}},
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
    choose, pick = _choose(virtual, fallback_large)
    # Only the first target's requests escalate (to the last).
    first = "target == SMALL" if virtual.steps else "not large"
    return f"""-- kvpilot: virtual model {virtual.name} ({virtual.scorer} scorer)
local SMALL, LARGE = {lua_string(virtual.small)}, {lua_string(virtual.large)}
local SMALL_JSON, LARGE_JSON = {lua_string(json.dumps(virtual.small))}, {lua_string(json.dumps(virtual.large))}
local THRESHOLD, TIE = {virtual.threshold!r}, {virtual.tie!r}
local CAP, FLOOR = {virtual.cap / 100!r}, {virtual.floor / 100!r}
local ESCALATES = {"true" if virtual.escalation is not None else "false"}
{_steps(virtual)}local decay = 1 - 1 / {GUARD_WINDOW}
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
  local score = stated(handle:headers():get({lua_string(virtual.header)}))
  local source = "header"
  local body = handle:body()
  local text = ""
  if body ~= nil then
    text = body:getBytes(0, body:length())
  end
  if score == nil then
{scoring}  end
{choose}  -- Handles taken before a yield (body(), httpCall) are invalid after it: fetch them again.
  local rewritten = string.gsub(text, '"model"%s*:%s*"[^"]*"', function()
    return '"model":' .. {pick}
  end, 1)
  if body ~= nil then
    handle:body():setBytes(rewritten)
  end
  local metadata = handle:streamInfo():dynamicMetadata()
  metadata:set("{METADATA_NAMESPACE}", "virtual", {lua_string(virtual.key)})
  metadata:set("{METADATA_NAMESPACE}", "target", target)
  if score ~= nil then
    metadata:set("{METADATA_NAMESPACE}", "score", string.format("%.4f", score))
  end
  metadata:set("{METADATA_NAMESPACE}", "source", source)
  metadata:set("{METADATA_NAMESPACE}", "forced", forced)
  local out = handle:headers()
  out:remove("{ESCALATE_HEADER}")
  if ESCALATES and {first} then
    out:replace("{ESCALATE_HEADER}", {lua_string(virtual.key)})
  end
  out:replace({lua_string(model_header)}, target)
end
"""
