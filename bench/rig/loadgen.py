"""Replay a `Workload` against an OpenAI-compatible URL and measure every request.

Each session is one asyncio task: it waits for its start time, sends its turns one after the
other (streaming, ``stream_options.include_usage``), each after the previous answer plus its
think time. Per request it records time to first token, end-to-end latency, tokens, cached
tokens, the replica that answered (``x-backend-id``) and any error. While the run lasts, a
sampler reads every replica's ``/metrics`` to follow its load.

Wall-clock times are divided by the time scale, so every number is in simulated seconds.
The run is bounded: requests have a timeout and the whole run a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bench.rig.jsonfields import known
from bench.rig.workload import Session, Workload


@dataclass
class RequestResult:
    """What happened to one request."""

    session: str
    turn: int
    start: float
    """Simulated seconds from the run start."""
    status: int = 0
    replica: str = ""
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    answer_matches: bool = False
    """The streamed text equals the workload's predicted answer."""
    engine_ttft: float | None = None
    """Time to first token as the simulated engine measured it, from the request's arrival
    at the replica (simulated seconds); None from servers that do not report it."""
    engine_latency: float | None = None
    """The same for the last token."""

    @property
    def ok(self) -> bool:
        return not self.error and self.status == 200

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestResult:
        """One request as `to_json` wrote it (a requests file of an older run: keys it did not
        write take their defaults, keys this version does not know are ignored)."""
        return cls(**known(cls, data))


@dataclass
class LoadSample:
    """One reading of every replica's queue, `at` simulated seconds into the run."""

    at: float
    in_flight: dict[str, float] = field(default_factory=dict)
    """Running plus waiting requests, by replica id."""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {name: value}, summing series that differ only in labels."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        if name.endswith("_bucket"):
            continue
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


async def _one_turn(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    session: Session,
    index: int,
    run_start: float,
    time_scale: float,
) -> RequestResult:
    turn = session.turns[index]
    sent = time.monotonic()
    result = RequestResult(session.id, index, (sent - run_start) / time_scale)
    body = {
        "model": model,
        "messages": list(turn.messages),
        "max_tokens": turn.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=session.headers()) as response:
            result.status = response.status_code
            result.replica = response.headers.get("x-backend-id", "")
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}"
                return result
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if piece:
                        if result.ttft is None:
                            result.ttft = (time.monotonic() - sent) / time_scale
                        pieces.append(piece)
                timing = chunk.get("engine_timing")
                if timing:
                    result.engine_ttft = timing.get("ttft")
                    result.engine_latency = timing.get("e2e")
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    result.completion_tokens = int(usage.get("completion_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
            if not done:
                result.error = "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        result.latency = (time.monotonic() - sent) / time_scale
    result.answer_matches = "".join(pieces) == turn.answer
    return result


async def _session(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    session: Session,
    run_start: float,
    time_scale: float,
    results: list[RequestResult],
    stop_at: float | None = None,
) -> None:
    await asyncio.sleep(max(0.0, run_start + session.start * time_scale - time.monotonic()))
    for index, turn in enumerate(session.turns):
        if index:
            await asyncio.sleep(turn.think * time_scale)
        if stop_at is not None and time.monotonic() - run_start > stop_at * time_scale:
            return
        results.append(await _one_turn(client, url, model, session, index, run_start, time_scale))


async def _sample_load(
    replicas: Sequence[tuple[str, str]],
    run_start: float,
    time_scale: float,
    interval: float,
    samples: list[LoadSample],
) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            sample = LoadSample((time.monotonic() - run_start) / time_scale)
            for replica_id, base_url in replicas:
                with contextlib.suppress(httpx.HTTPError):
                    values = parse_metrics((await client.get(f"{base_url}/metrics")).text)
                    sample.in_flight[replica_id] = values.get(
                        "vllm:num_requests_running", 0.0
                    ) + values.get("vllm:num_requests_waiting", 0.0)
            samples.append(sample)
            await asyncio.sleep(interval)


@dataclass
class RunResult:
    """Everything one replay measured."""

    results: list[RequestResult]
    samples: list[LoadSample]
    wall_seconds: float
    timed_out: bool
    late: float = 0.0
    """Wall-clock seconds the replay began after the moment it was meant to."""


async def replay(
    workload: Workload,
    url: str,
    *,
    model: str,
    time_scale: float,
    replicas: Sequence[tuple[str, str]] = (),
    deadline: float = 600.0,
    request_timeout: float = 300.0,
    sample_interval: float = 0.5,
    on_start: Callable[[float], object] | None = None,
    stop_at: float | None = None,
) -> RunResult:
    """Send the whole workload to `url`; `replicas` are (id, base URL) pairs to sample.

    With `stop_at` (simulated seconds) sessions send no turn after that moment: the offered
    load stays steady to the end instead of trailing off while the last sessions finish.

    Stops at `deadline` wall-clock seconds even if sessions are unfinished (their missing
    turns are then absent from the results, and `timed_out` is set). `on_start` is called
    with the ``time.monotonic()`` moment simulated time 0 falls on, once the client is
    ready: a caller that schedules events of its own (a slowdown) keeps the replay's clock.
    """
    results: list[RequestResult] = []
    samples: list[LoadSample] = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    timeout = httpx.Timeout(request_timeout, connect=10.0)
    # Without TCP_NODELAY the request body waits for the ACK of its headers (Nagle against
    # delayed ACK), up to 200 ms added to every time to first token.
    transport = httpx.AsyncHTTPTransport(
        limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    )
    async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
        # The clock starts once the client exists: building it (TLS context and all) took
        # seconds of wall time on a loaded machine, and every session due meanwhile would
        # have left late and at once.
        started = time.monotonic()
        if on_start is not None:
            on_start(started)
        sampler = asyncio.create_task(
            _sample_load(replicas, started, time_scale, sample_interval, samples)
        )
        tasks = [
            asyncio.create_task(
                _session(client, url, model, session, started, time_scale, results, stop_at)
            )
            for session in workload.sessions
        ]
        _, pending = await asyncio.wait(tasks, timeout=deadline)
        for task in [*pending, sampler]:
            task.cancel()
        await asyncio.gather(*pending, sampler, return_exceptions=True)
    return RunResult(results, samples, time.monotonic() - started, bool(pending))
