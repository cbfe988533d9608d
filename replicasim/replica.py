"""One simulated OpenAI-compatible model replica: its state, switches and counters, and its
HTTP app (Starlette). `replicasim.server` serves several of them in one process.

The app serves:

- `POST /v1/chat/completions`, `POST /v1/completions`: OpenAI-shaped JSON, or SSE chunks
  ending in `data: [DONE]` when the request has `"stream": true`;
- `GET /health`: 200, or 503 after `POST /admin/health {"healthy": false}`;
- `GET /metrics`: Prometheus text with request counters and vLLM-style gauges
  (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`);
- `POST /admin/fail {"status": 503}`: answer every inference request with that status
  (`{"status": 0}` recovers; 429 works too); `"fraction": 0.2` fails every fifth only;
- `POST /admin/slow {"delay": 0.05}`: wait that many seconds before every answer.

A replica with LoRA slots (`replicasim.lora`) also serves adapters: `GET /v1/models` lists the
base model and the loaded adapters (each with `parent`), a request for an adapter of its catalog
that is not loaded waits for its load, a name that is neither gets vLLM's 404, and
`POST /admin/adapters {"load": [...], "unload": [...]}` loads and unloads them at once.

A replica in a region (``--region``) adds a simulated inter-region round trip
(``--remote-delay``, seconds) to every inference request whose ``x-client-region`` header
names another region: the time a request from another region's Envoy would spend on the
wire, there and back, before its first token reaches the client.

A replica with an `Engine` (`replicasim.simulator`) answers through it instead of at once:
continuous batching, a prefix-cached KV cache, simulated prefill and decode times, vLLM's
metric names (prefix-cache hits, TTFT histogram) and optional ORCA load headers. Such
replicas also take:

- `POST /admin/slow {"factor": 4}`: every engine step takes 4x longer (1 recovers);
- `POST /admin/die`: the replica aborts its requests and stops listening (the others go on);
- `POST /admin/reset`: drop the unreferenced prefix cache and zero the engine's counters
  (`{"cache": "keep"}` zeroes the counters only, after warming the cache; `{"kv_blocks": N}`
  gives an idle replica an empty KV cache of N blocks; `{"preload": [{"messages": [...]}]}`
  then puts those chat prompts in the cache without serving them).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from replicasim.completions import completion_response
from replicasim.lora import LoraSlots, UnknownAdapter
from replicasim.provider import RateLimit, rate_limited_body
from replicasim.simulator import Engine, EngineError

DEFAULT_MODEL = "sim-model"
CLIENT_REGION_HEADER = "x-client-region"
"""Request header naming the region a request comes from (the load generator sets it)."""


@dataclass
class Replica:
    """One simulated model server: its identity, its switches and its counters."""

    id: str
    model: str = DEFAULT_MODEL
    healthy: bool = True
    """`GET /health` answers 503 when False."""
    fail_status: int | None = None
    """When set, inference requests are answered with this HTTP status."""
    fail_fraction: float = 1.0
    """Share of inference requests that ``fail_status`` answers, spread evenly (0.2: every
    fifth)."""
    delay: float = 0.0
    """Seconds every inference request waits before its answer (`/admin/slow {"delay": s}`)."""
    inference: int = 0
    """Inference requests received (the even spread of failures counts them)."""
    running: int = 0
    """Requests being answered right now (the `vllm:num_requests_running` gauge)."""
    waiting: int = 0
    """Queued requests (`vllm:num_requests_waiting`); nothing queues yet, so always 0."""
    kv_cache_usage: float = 0.0
    """KV cache use from 0 to 1 (`vllm:kv_cache_usage_perc`); static for now."""
    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    """Answered requests by (path, status)."""
    engine: Engine | None = None
    """The simulated inference engine, when the replica simulates one."""
    dead: bool = False
    """Set by `POST /admin/die`: the replica has stopped serving."""
    on_death: Callable[[], None] | None = None
    """Called once by `POST /admin/die`; `serve()` sets it to stop this replica's server."""
    lora: LoraSlots | None = None
    """LoRA adapters the replica can load, when it serves any."""
    region: str = ""
    """The region the replica simulates running in; empty: none."""
    remote_delay: float = 0.0
    """Seconds of round trip added to a request from another region (``x-client-region``)."""
    remote_requests: int = 0
    """Inference requests that came from another region."""
    rate_limit: RateLimit | None = None
    """A paid API's rate limit (``SimConfig.rate_limit``), made with the engine."""

    def __post_init__(self) -> None:
        config = self.engine.config if self.engine is not None else None
        if config is not None and config.rate_limit > 0:
            self.rate_limit = RateLimit(config.rate_limit, config.rate_burst or config.rate_limit)

    def metrics_text(self) -> str:
        """The replica's metrics in Prometheus text format."""
        model = f'model_name="{self.model}"'
        lines = [
            "# HELP kvpilot_backend_requests_total Requests answered, by path and status.",
            "# TYPE kvpilot_backend_requests_total counter",
        ]
        for (path, status), count in sorted(self.requests.items()):
            lines.append(
                f'kvpilot_backend_requests_total{{backend="{self.id}",path="{path}",'
                f'status="{status}"}} {count}'
            )
        if self.lora is not None:
            lines += self.lora.metrics_lines()
        if self.engine is not None:
            return "\n".join([*lines, *self.engine.metrics_lines()]) + "\n"
        gauges = [
            ("vllm:num_requests_running", "Number of requests running.", float(self.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting.", float(self.waiting)),
            (
                "vllm:kv_cache_usage_perc",
                "KV cache usage, 1 means 100 percent.",
                self.kv_cache_usage,
            ),
        ]
        for name, help_text, value in gauges:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} gauge",
                f"{name}{{{model}}} {value}",
            ]
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- HTTP app


def _completion_body(replica: Replica, kind: str, model: str) -> dict[str, Any]:
    text = f"Hello from {replica.id}."
    created = int(time.time())
    usage = {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        obj, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
        obj, prefix = "text_completion", "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
        "backend": replica.id,
    }


def _stream_chunks(replica: Replica, kind: str, model: str) -> Iterator[dict[str, Any]]:
    """The answer as OpenAI streaming chunks, one word each, the last one with finish_reason."""
    words = f"Hello from {replica.id}.".split(" ")
    chunk_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    for i, word in enumerate([*words, ""]):
        last = i == len(words)
        piece = word if i == 0 else ("" if last else " " + word)
        choice: dict[str, Any]
        if kind == "chat":
            delta: dict[str, Any] = {"content": piece} if not last else {}
            if i == 0:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece, "finish_reason": "stop" if last else None}
            obj = "text_completion"
        yield {
            "id": chunk_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "backend": replica.id,
        }


async def _releasing(body: Any, lora: LoraSlots, model: str) -> AsyncIterator[Any]:
    """A streamed answer that holds its adapter until its last chunk is sent."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        lora.release(model)


def build_app(replica: Replica) -> Starlette:
    """The HTTP app of one replica."""
    headers = {"x-backend-id": replica.id}

    def error(status: int, message: str, path: str) -> JSONResponse:
        replica.requests[(path, status)] += 1
        body = {
            "error": {"message": message, "type": "error", "code": status},
            "backend": replica.id,
        }
        return JSONResponse(body, status_code=status, headers=headers)

    async def completions(request: Request) -> Response:
        path = request.url.path
        kind = "chat" if path.endswith("/chat/completions") else "text"
        replica.inference += 1
        if replica.delay:
            await asyncio.sleep(replica.delay)
        client_region = request.headers.get(CLIENT_REGION_HEADER, "")
        if replica.region and client_region and client_region != replica.region:
            replica.remote_requests += 1
            if replica.remote_delay:
                await asyncio.sleep(replica.remote_delay)
        if replica.fail_status is not None and int(replica.inference * replica.fail_fraction) > int(
            (replica.inference - 1) * replica.fail_fraction
        ):
            return error(replica.fail_status, f"{replica.id} is set to fail", path)
        try:
            payload = await request.json()
        except ValueError:
            return error(400, "request body is not valid JSON", path)
        if not isinstance(payload, dict):
            return error(400, "request body must be a JSON object", path)
        model = str(payload.get("model") or replica.model)
        lora = replica.lora if model != replica.model else None
        if lora is not None:
            try:
                await lora.acquire(model)
            except UnknownAdapter:
                # vLLM's answer for a model it neither serves nor can load.
                replica.requests[(path, 404)] += 1
                body = {
                    "error": {
                        "message": f"The model `{model}` does not exist.",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": 404,
                    },
                    "backend": replica.id,
                }
                return JSONResponse(body, status_code=404, headers=headers)
            try:
                response = await answer(request, path, kind, model, payload)
            except BaseException:
                lora.release(model)
                raise
            if isinstance(response, StreamingResponse):
                response.body_iterator = _releasing(response.body_iterator, lora, model)
            else:
                lora.release(model)
            return response
        return await answer(request, path, kind, model, payload)

    async def answer(
        request: Request, path: str, kind: str, model: str, payload: dict[str, Any]
    ) -> Response:
        if replica.engine is not None:
            config = replica.engine.config
            if replica.rate_limit is not None:
                wait = replica.rate_limit.take(time.monotonic() / config.time_scale)
                if wait is not None:
                    replica.requests[(path, 429)] += 1
                    return JSONResponse(
                        rate_limited_body(wait),
                        status_code=429,
                        headers={**headers, "retry-after": str(wait)},
                    )
            if config.first_token_delay:
                await asyncio.sleep(config.first_token_delay * config.time_scale)
            try:
                response = await completion_response(
                    replica.engine, kind, model, payload, headers, replica.id
                )
            except EngineError as exc:
                return error(exc.status, str(exc), path)
            replica.requests[(path, response.status_code)] += 1
            return response
        replica.requests[(path, 200)] += 1
        if not payload.get("stream"):
            return JSONResponse(_completion_body(replica, kind, model), headers=headers)

        async def events() -> AsyncIterator[str]:
            replica.running += 1
            try:
                for chunk in _stream_chunks(replica, kind, model):
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                replica.running -= 1

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def models(request: Request) -> Response:
        entries = [
            {
                "id": replica.model,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": replica.model,
                "parent": None,
            }
        ]
        if replica.lora is not None:
            entries += replica.lora.models_entries(replica.model)
        return JSONResponse({"object": "list", "data": entries}, headers=headers)

    async def admin_adapters(request: Request) -> Response:
        lora = replica.lora
        try:
            body = await request.json()
            load = body.get("load", [])
            unload = body.get("unload", [])
            if not all(isinstance(n, str) for n in [*load, *unload]):
                raise TypeError
        except (ValueError, TypeError, AttributeError):
            return JSONResponse(
                {"error": 'expected {"load": [names], "unload": [names]}'}, 400, headers=headers
            )
        if lora is None:
            return JSONResponse(
                {"error": "this replica serves no adapters (--lora)"}, 404, headers=headers
            )
        try:
            lora.unload(unload)
            lora.load(load)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, 409, headers=headers)
        return JSONResponse(
            {"id": replica.id, "loaded": sorted(lora.loaded), "loads": lora.loads},
            headers=headers,
        )

    async def health(request: Request) -> Response:
        status = 200 if replica.healthy else 503
        return PlainTextResponse("ok" if replica.healthy else "unhealthy", status, headers=headers)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(
            replica.metrics_text(), headers={**headers, "content-type": "text/plain; version=0.0.4"}
        )

    async def admin_fail(request: Request) -> Response:
        try:
            body = await request.json()
            status = int(body["status"])
            fraction = float(body.get("fraction", 1.0))
        except (ValueError, KeyError, TypeError, AttributeError):
            return JSONResponse(
                {"error": 'expected {"status": <int>, "fraction": <0-1, default 1>}'},
                400,
                headers=headers,
            )
        if status != 0 and not 100 <= status <= 599:
            return JSONResponse({"error": "status must be 0 or 100-599"}, 400, headers=headers)
        if not 0 < fraction <= 1:
            return JSONResponse({"error": "fraction must be in (0, 1]"}, 400, headers=headers)
        replica.fail_status = status or None
        replica.fail_fraction = fraction
        return JSONResponse(
            {"id": replica.id, "fail_status": status, "fraction": fraction}, headers=headers
        )

    async def admin_health(request: Request) -> Response:
        try:
            healthy = (await request.json())["healthy"]
        except (ValueError, KeyError, TypeError):
            healthy = None
        if not isinstance(healthy, bool):
            return JSONResponse({"error": 'expected {"healthy": true|false}'}, 400, headers=headers)
        replica.healthy = healthy
        return JSONResponse({"id": replica.id, "healthy": healthy}, headers=headers)

    def engine_of(request: Request) -> Engine:
        if replica.engine is None:
            raise EngineError(404, "this replica does not simulate an engine (--simulate)")
        return replica.engine

    async def admin_slow(request: Request) -> Response:
        try:
            body = await request.json()
            if isinstance(body, dict) and "delay" in body:
                delay = float(body["delay"])
                if not 0 <= delay <= 60:
                    raise ValueError
                replica.delay = delay
                return JSONResponse({"id": replica.id, "delay": delay}, headers=headers)
            engine = engine_of(request)
            factor = float(body["factor"])
        except EngineError as exc:
            return JSONResponse({"error": str(exc)}, exc.status, headers=headers)
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": 'expected {"factor": <number>}'}, 400, headers=headers)
        if not 0 < factor <= 1000:
            return JSONResponse({"error": "factor must be in (0, 1000]"}, 400, headers=headers)
        engine.slow_factor = factor
        return JSONResponse({"id": replica.id, "factor": factor}, headers=headers)

    async def admin_reset(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        drop_cache = body.get("cache", "drop") != "keep"
        kv_blocks = body.get("kv_blocks")
        if kv_blocks is not None and (not isinstance(kv_blocks, int) or kv_blocks < 1):
            return JSONResponse(
                {"error": "kv_blocks must be a positive integer"}, 400, headers=headers
            )
        preload = body.get("preload", [])
        if not isinstance(preload, list) or not all(isinstance(p, dict) for p in preload):
            return JSONResponse(
                {"error": 'preload must be a list of chat payloads ({"messages": [...]})'},
                400,
                headers=headers,
            )
        try:
            engine = engine_of(request)
            result = engine.reset(drop_cache=drop_cache, kv_blocks=kv_blocks)
            if preload:
                result["cached_blocks"] = engine.preload(preload)
        except EngineError as exc:
            return JSONResponse({"error": str(exc)}, exc.status, headers=headers)
        replica.requests.clear()
        if replica.lora is not None:
            replica.lora.reset()
        return JSONResponse({"id": replica.id, **result}, headers=headers)

    async def admin_die(request: Request) -> Response:
        replica.dead = True
        if replica.engine is not None:
            replica.engine.abort_all(f"{replica.id} died")
        if replica.on_death is not None:
            replica.on_death()
        return JSONResponse({"id": replica.id, "dead": True}, headers=headers)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/admin/adapters", admin_adapters, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/admin/fail", admin_fail, methods=["POST"]),
            Route("/admin/health", admin_health, methods=["POST"]),
            Route("/admin/slow", admin_slow, methods=["POST"]),
            Route("/admin/reset", admin_reset, methods=["POST"]),
            Route("/admin/die", admin_die, methods=["POST"]),
        ]
    )
