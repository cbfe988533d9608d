"""Token accounting in Envoy: a Lua filter that reads the OpenAI ``usage`` object of every
response as its body passes, and the listener's access log that carries the counts to kvpilot.

Why this shape (docs/cost.md has the measurements):

- The filter iterates the response with ``bodyChunks()``, which hands each chunk on as soon as
  the script has looked at it: a streamed answer is never buffered, so the client's time to
  first token does not wait for the last chunk. Counts are read from the text with patterns
  (``"prompt_tokens": N``), the last value seen winning, across chunk boundaries (a short
  tail of the previous chunk is kept). A quote inside generated text is escaped (``\\"``),
  so a model that writes ``"prompt_tokens": 5`` in its answer cannot forge a count.
- A streamed request without ``stream_options.include_usage`` gets it added (the request body
  is small and is buffered anyway for model routing), so every stream is counted and a tenant
  cannot leave its budget by streaming. The usage-only event that the client did not ask for
  is removed from the stream again, so such a client sees what it would have seen without
  kvpilot.
- The counts go into dynamic metadata (namespace ``kvpilot.usage``) as soon as a chunk
  carries them, not at the end of the stream: a client that closes its connection once it
  has read the last event (before the stream's end reached Envoy) resets the stream, the
  script never gets past its loop, and the usage it was sent must still count. Only the
  connection manager's access log sees them: the router's upstream log is written before the response
  body has passed the filter (seen with Envoy 1.40). That log goes to kvpilot's access log
  service with the tenant header, and kvpilot aggregates (``xdsserver.usage``).
"""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, grpc_service_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from xdsserver.translate.metadata import GATE_UPSTREAM, pool_tag
from xdsserver.translate.protos import duration, pack

USAGE_FILTER = "kvpilot.usage"
"""The Lua filter's name, and the dynamic metadata namespace it writes."""
USAGE_LOG_PREFIX = "kvpilot.usage/"
"""Log name of the usage access log (``kvpilot.usage/<listener>``): kvpilot's access log
service tells usage entries from upstream signal entries by it."""
USAGE_FLUSH_INTERVAL = 0.1
"""Seconds Envoy buffers usage entries before sending them; part of a budget's lag
(docs/cost.md: the overshoot bound)."""
USAGE_SIGNALS_CLUSTER = "kvpilot_signals"
"""The bootstrap cluster that reaches kvpilot's access log service (deploy/envoy/)."""
_TAIL = 512
"""Bytes of a chunk kept for the next one, so a count split across two chunks is read."""

USAGE_LUA = f"""-- kvpilot: token usage of OpenAI responses, read as the body passes (never buffered)
local NS = "{USAGE_FILTER}"

local function last_number(text, key, old)
  local value, at = old, 1
  while true do
    local s, e, digits = string.find(text, '"' .. key .. '"%s*:%s*(%d+)', at)
    if s == nil then
      return value
    end
    value, at = tonumber(digits), e + 1
  end
end

local function record(handle, prompt, cached, completion, model)
  local md = handle:streamInfo():dynamicMetadata()
  md:set(NS, "prompt", prompt or 0)
  md:set(NS, "cached", cached or 0)
  md:set(NS, "completion", completion or 0)
  if model ~= nil then
    md:set(NS, "model", model)
  end
end

function envoy_on_request(handle)
  if handle:headers():get(":method") ~= "POST" then
    return
  end
  local body = handle:body()
  if body == nil then
    return
  end
  local text = body:getBytes(0, body:length())
  if not string.find(text, '"stream"%s*:%s*true') or
      string.find(text, '"include_usage"%s*:%s*true') then
    return
  end
  -- A stream that did not ask for usage: ask for it, and take the event out again below.
  local new, n = string.gsub(text, '"include_usage"%s*:%s*false', '"include_usage":true', 1)
  if n == 0 then
    new, n = string.gsub(text, '"stream_options"%s*:%s*null',
      '"stream_options":{{"include_usage":true}}', 1)
  end
  if n == 0 then
    new, n = string.gsub(text, '"stream_options"%s*:%s*{{%s*}}',
      '"stream_options":{{"include_usage":true}}', 1)
  end
  if n == 0 then
    new, n = string.gsub(text, '"stream_options"%s*:%s*{{',
      '"stream_options":{{"include_usage":true,', 1)
  end
  if n == 0 then
    new, n = string.gsub(text, '^%s*{{', '{{"stream_options":{{"include_usage":true}},', 1)
  end
  if n == 1 then
    body:setBytes(new)
    handle:streamInfo():dynamicMetadata():set(NS, "added", true)
  end
end

function envoy_on_response(handle)
  -- Behind a route's gate: the replica that answered, kept for the log, not for the client.
  local upstream = handle:headers():get("{GATE_UPSTREAM}")
  if upstream ~= nil then
    handle:headers():remove("{GATE_UPSTREAM}")
    handle:streamInfo():dynamicMetadata():set(NS, "upstream", upstream)
  end
  local reset = handle:headers():get("x-kvpilot-budget-reset")
  if reset ~= nil then
    -- A tenant past its budget: Retry-After in seconds to the window's end.
    handle:headers():replace("retry-after", tostring(math.max(1, tonumber(reset) - os.time())))
    return
  end
  local prompt, cached, completion, model
  local tail = ""
  local meta = handle:streamInfo():dynamicMetadata():get(NS)
  local added = meta ~= nil and meta["added"]
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size > 0 then
      local bytes = chunk:getBytes(0, size)
      local text = tail .. bytes
      if model == nil then
        model = string.match(text, '"model"%s*:%s*"([^"]*)"')
      end
      if string.find(text, '_tokens"', 1, true) then
        prompt = last_number(text, "prompt_tokens", prompt)
        completion = last_number(text, "completion_tokens", completion)
        cached = last_number(text, "cached_tokens", cached)
        -- Recorded at once: a client that closes its connection after the last event
        -- (before the end of the stream reaches Envoy) ends the stream here, and the
        -- usage it was sent still counts.
        if prompt ~= nil or completion ~= nil then
          record(handle, prompt, cached, completion, model)
        end
        if added then
          local kept, n = string.gsub(bytes,
            'data: {{[^\\n]-"choices"%s*:%s*%[%s*%][^\\n]-"usage"[^\\n]*\\n\\n', '')
          if n > 0 then
            chunk:setBytes(kept)
          end
        end
      end
      tail = string.sub(text, -{_TAIL})
    end
  end
  if prompt ~= nil or completion ~= nil then
    record(handle, prompt, cached, completion, model)
  end
end
"""


def usage_filter() -> hcm_pb2.HttpFilter:
    """The accounting filter, first in the chain: it sees the response last, as the client
    gets it."""
    return hcm_pb2.HttpFilter(
        name=USAGE_FILTER,
        typed_config=pack(
            lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=USAGE_LUA))
        ),
    )


def usage_log(listener: str, tenant_headers: Iterable[str]) -> accesslog_pb2.AccessLog:
    """The connection manager's log of every request to kvpilot's access log service, with
    the usage metadata, the tenant headers of the listener's routes and the answering
    host's pool tag. Envoy buffers entries
    for ``USAGE_FLUSH_INTERVAL`` and sends them in batches over one gRPC stream."""
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc",
        typed_config=pack(
            als_pb2.HttpGrpcAccessLogConfig(
                common_config=als_pb2.CommonGrpcAccessLogConfig(
                    log_name=USAGE_LOG_PREFIX + listener,
                    transport_api_version=config_source_pb2.V3,
                    grpc_service=grpc_service_pb2.GrpcService(
                        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(
                            cluster_name=USAGE_SIGNALS_CLUSTER
                        )
                    ),
                    buffer_flush_interval=duration(USAGE_FLUSH_INTERVAL),
                    # The pool of the host that served the last attempt, where its address
                    # cannot tell it: a provider's address is a DNS name.
                    custom_tags=[pool_tag()],
                ),
                additional_request_headers_to_log=sorted(set(tenant_headers)),
            )
        ),
    )
