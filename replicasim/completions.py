"""OpenAI completion requests served through a simulated engine: JSON, or SSE chunks.

A replica (`replicasim.replica`) hands each request to `completion_response`, which queues it in
the replica's `Engine` and answers once the engine has generated every token, or streams the
tokens as the engine steps. The usage block carries the prompt tokens found in the prefix
cache, and with ``stream_options.include_usage`` the request's timing as the engine saw it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from replicasim.simulator import Engine, EngineError, prompt_tokens


async def completion_response(
    engine: Engine,
    kind: str,
    model: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    backend_id: str,
) -> Response:
    """Serve one OpenAI completion request through the engine (JSON or SSE)."""
    prompt = prompt_tokens(kind, payload)
    max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or 16
    if not isinstance(max_tokens, int):
        raise EngineError(400, "max_tokens must be an integer")
    seq = engine.submit(prompt, max_tokens)
    if engine.config.orca:
        headers = {**headers, "endpoint-load-metrics": engine.orca_header()}
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex[:16]}"
    created = int(time.time())

    def usage() -> dict[str, Any]:
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": seq.generated,
            "total_tokens": len(prompt) + seq.generated,
            "prompt_tokens_details": {"cached_tokens": seq.hit_tokens},
        }

    def engine_timing() -> dict[str, float | None]:
        """The request as the engine saw it, in simulated seconds from its arrival at the
        replica: what a routing policy changes (queueing, prefill, batch), without the HTTP
        path of the load generator, which a busy machine slows for every policy alike."""
        scale = engine.config.time_scale

        def since_arrival(at: float | None) -> float | None:
            return None if at is None else (at - seq.arrival) / scale

        return {"ttft": since_arrival(seq.first_token_at), "e2e": since_arrival(seq.finished_at)}

    if not payload.get("stream"):
        try:
            while not seq.finished:
                seq.changed.clear()
                await seq.changed.wait()
        finally:
            engine.abort(seq, "client went away")
        if seq.error:
            raise EngineError(503, f"{backend_id}: {seq.error}")
        text = " ".join(seq.words)
        choice: dict[str, Any]
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = "length"
        body = {
            "id": request_id,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage(),
            "backend": backend_id,
        }
        return JSONResponse(body, headers=headers)

    include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(piece: str | None, finish: str | None, first: bool) -> str:
        if kind == "chat":
            delta: dict[str, Any] = {} if piece is None else {"content": piece}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish}
        body = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "backend": backend_id,
        }
        return f"data: {json.dumps(body)}\n\n"

    async def events() -> AsyncIterator[str]:
        sent = 0
        try:
            while True:
                if seq.error:
                    # Mid-stream failure, as a dying server would leave it: no [DONE].
                    raise ConnectionAbortedError(seq.error)
                if seq.generated > sent:
                    piece = " ".join(seq.words[sent : seq.generated])
                    yield chunk(piece if sent == 0 else " " + piece, None, sent == 0)
                    sent = seq.generated
                    if not seq.finished:
                        # Coalesce the next tokens: one chunk per interval, not per token,
                        # but the last one as soon as the sequence ends (exact latency).
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(engine.config.stream_interval):
                                await seq.done.wait()
                        continue
                if seq.finished:
                    break
                seq.changed.clear()
                await seq.changed.wait()
            yield chunk(None, "length", False)
            if include_usage:
                body = {
                    "id": request_id,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(),
                    "backend": backend_id,
                    "engine_timing": engine_timing(),
                }
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            engine.abort(seq, "client went away")

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
