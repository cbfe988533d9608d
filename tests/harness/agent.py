"""Telemetry end to end: a model-server stand-in whose `/metrics` the test controls, and
`kvpilot agent` as its own process."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from controlplane.local import free_port, repo_root


class MetricsBackend:
    """A model-server stand-in on its own thread: `/metrics` serves `metrics` (vLLM names by
    default), `/v1/chat/completions` answers with the backend's id and, when `utilization` is
    set, an ORCA `endpoint-load-metrics` header. `status` other than 200 fails everything."""

    def __init__(self, backend_id: str = "be", *, waiting: float = 0, kv: float = 0.0) -> None:
        self.id = backend_id
        self.waiting = waiting
        self.running = 0.0
        self.kv = kv
        self.utilization: float | None = None
        self.tpot: float | None = None
        """When set, every /metrics read shows 100 more output tokens at this many seconds
        each (vLLM's time-per-output-token histogram), as a replica decoding steadily."""
        self._tokens = 0.0
        self._token_seconds = 0.0
        self.status = 200
        self.extra_metrics = ""
        self.models: Any = None
        """The JSON `/v1/models` answers; None: 404, as a server that lists nothing."""
        self.models_status = 200
        """Status of `/v1/models` (other than 200: a model list that cannot be read)."""
        self.received: list[dict[str, str]] = []
        """The headers of every chat completion request received, in order."""
        self.port = free_port()
        app = Starlette(
            routes=[
                Route("/metrics", self._metrics),
                Route("/health", self._health),
                Route("/v1/models", self._models),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
            ]
        )
        self._server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
            )
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics(self) -> str:
        decoding = ""
        if self.tpot is not None:
            self._tokens += 100
            self._token_seconds += 100 * self.tpot
            decoding = (
                f'vllm:time_per_output_token_seconds_sum{{model_name="m"}} {self._token_seconds}\n'
                f'vllm:time_per_output_token_seconds_count{{model_name="m"}} {self._tokens}\n'
            )
        return (
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv}\n'
            + decoding
            + self.extra_metrics
        )

    async def _metrics(self, request: Request) -> Response:
        if self.status != 200:
            return PlainTextResponse("down", self.status)
        return PlainTextResponse(self.metrics)

    async def _models(self, request: Request) -> Response:
        if self.models is None:
            return PlainTextResponse("not found", 404)
        if self.models_status != 200:
            return PlainTextResponse("broken", self.models_status)
        return JSONResponse(self.models)

    async def _health(self, request: Request) -> Response:
        return PlainTextResponse("ok", self.status)

    async def _complete(self, request: Request) -> Response:
        self.received.append(dict(request.headers))
        headers = {"x-backend-id": self.id}
        if self.utilization is not None:
            # Envoy's weight is rps_fractional / utilization, and it rejects reports without
            # a positive rate; equal rates let the utilization alone decide.
            headers["endpoint-load-metrics"] = (
                f"TEXT application_utilization={self.utilization}, rps_fractional=100"
            )
        return JSONResponse({"backend": self.id}, self.status, headers=headers)

    def start(self) -> MetricsBackend:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"test backend on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


def agent_argv(
    etcd_endpoint: str,
    etcd_prefix: str,
    pool: str,
    backend_urls: Sequence[str],
    *,
    register: bool = False,
    refresh: float | None = None,
) -> list[str]:
    """The `kvpilot agent` command line for ``backend_urls`` in ``pool``, reporting every
    0.2 s; with ``register``, each backend is registered under a 2 s lease (a killed agent's
    keys expire within seconds)."""
    return [
        sys.executable,
        "-m",
        "commands.agent",
        "--etcd-endpoints",
        etcd_endpoint,
        "--etcd-prefix",
        etcd_prefix,
        "--pool",
        pool,
        *[arg for url in backend_urls for arg in ("--backend", url)],
        "--interval",
        "0.2",
        *(["--register", "--ttl", "2"] if register else []),
        *(["--refresh", str(refresh)] if refresh is not None else []),
    ]


async def start_agent_process(
    etcd_endpoint: str, etcd_prefix: str, pool: str, backend_url: str
) -> asyncio.subprocess.Process:
    """`kvpilot agent` as its own process, registering one backend with a 2 s lease and
    reporting every 0.2 s, so a test can kill it and watch its keys expire."""
    return await asyncio.create_subprocess_exec(
        *agent_argv(etcd_endpoint, etcd_prefix, pool, [backend_url], register=True),
        cwd=repo_root(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@contextlib.contextmanager
def agent_running(
    etcd_endpoint: str,
    etcd_prefix: str,
    pool: str,
    backend_urls: Sequence[str],
    *,
    log: Path,
    refresh: float | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`kvpilot agent` scraping ``backend_urls`` (without registering them) for the length of
    the block, its stderr in ``log``; stopped on the way out."""
    with log.open("w") as stderr:
        agent = subprocess.Popen(
            agent_argv(etcd_endpoint, etcd_prefix, pool, backend_urls, refresh=refresh),
            cwd=repo_root(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            yield agent
        finally:
            agent.terminate()
            agent.wait(10)
