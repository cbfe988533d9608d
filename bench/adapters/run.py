"""Adapter-aware routing against adapter-blind routing, side by side on one fleet.

8 simulated vLLM replicas behind a real Envoy configured by kvpilot, each able to hold at
most 8 of 40 LoRA adapters at once (loading another one takes ``load_time`` and evicts the
least recently used idle one). Requests arrive open loop (Poisson) and ask for adapters with
Zipf popularity. Both runs replay the same arrivals from empty replicas:

- ``blind``: the route matches the pool's discovered models but balances over every replica
  (``adapters.affinity: false``): a request lands wherever least request puts it;
- ``aware``: the same route with adapter-aware routing (``adapters.affinity: true``): a
  request goes to the replicas whose agent reports the adapter loaded, and an adapter loaded
  nowhere to any replica (fallback ``base``), which loads it.

Measured: time to first token (p50, p99; streamed, as the client sees it) and adapter loads
per 1,000 requests (the replicas' own counters). Target: aware at most half of blind's loads.

Run it:  python -m bench adapters [--short] [--out DIR] [--state-dir DIR]
(``bench.adapters.entry`` registers it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.adapters.config import AdaptersConfig
from bench.adapters.results import AdapterRun, Steady
from bench.rig.loadgen import parse_metrics
from bench.rig.stack import chat_url, say, start_agent
from bench.rig.summary import percentile
from controlplane.local import free_port, local_stack
from controlplane.local.replicas import BackendProcess

POOL = "lora"
BASE = "sim-model"


POLICIES: dict[str, dict[str, Any]] = {
    "blind": {"adapters": {"affinity": False, "fallback": "base"}},
    "aware": {"adapters": {"affinity": True, "fallback": "base"}},
}


def adapter_names(config: AdaptersConfig) -> list[str]:
    return [f"lora-{k}" for k in range(config.adapters)]


def arrivals(config: AdaptersConfig) -> list[tuple[float, str]]:
    """(seconds after the start, adapter) of every request: the same for every policy."""
    rng = random.Random(config.seed)
    names = adapter_names(config)
    weights = [1 / (k + 1) ** config.zipf for k in range(config.adapters)]
    at = 0.0
    out = []
    for _ in range(config.requests):
        at += rng.expovariate(config.rate)
        out.append((at, rng.choices(names, weights)[0]))
    return out


@dataclass
class Outcome:
    """One request: its adapter, status, time to first token, and who answered."""

    adapter: str
    status: int
    ttft: float | None
    replica: str
    offset: float = 0.0
    """When it was sent, seconds after the start."""


async def _one(
    client: httpx.AsyncClient, url: str, adapter: str, index: int, max_tokens: int
) -> Outcome:
    body = {
        "model": adapter,
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"request {index} for {adapter}: summarize."}],
    }
    started = time.monotonic()
    try:
        async with client.stream("POST", url, json=body) as response:
            replica = response.headers.get("x-backend-id", "envoy")
            if response.status_code != 200:
                await response.aread()
                return Outcome(adapter, response.status_code, None, replica)
            ttft = None
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                    ttft = time.monotonic() - started
            return Outcome(adapter, 200, ttft, replica)
    except httpx.HTTPError:
        return Outcome(adapter, 0, None, "")


async def replay(
    url: str,
    plan: list[tuple[float, str]],
    max_tokens: int,
    *,
    warmup: float,
    at_warmup: Callable[[], dict[str, float]],
) -> tuple[list[Outcome], dict[str, float]]:
    """Send every request at its arrival time (open loop) and wait for all answers; also
    what `at_warmup` returned when the warm-up ended (the replicas' load counters)."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        start = time.monotonic()

        async def at(offset: float, adapter: str, index: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            outcome = await _one(client, url, adapter, index, max_tokens)
            outcome.offset = offset
            return outcome

        async def counters() -> dict[str, float]:
            await asyncio.sleep(max(0.0, start + warmup - time.monotonic()))
            return await asyncio.to_thread(at_warmup)

        warm = asyncio.create_task(counters())
        outcomes = await asyncio.gather(
            *(at(offset, adapter, i) for i, (offset, adapter) in enumerate(plan))
        )
        return outcomes, await warm


def _loads(backends: BackendProcess) -> dict[str, float]:
    """Adapter loads per replica since its last reset."""
    return {
        replica.id: parse_metrics(httpx.get(f"{replica.url}/metrics", timeout=5).text).get(
            "kvpilot_sim_lora_loads_total", 0.0
        )
        for replica in backends.replicas
    }


def _listed(listener_port: int) -> set[str] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        response = httpx.get(f"http://127.0.0.1:{listener_port}/v1/models", timeout=5)
        if response.status_code == 200:
            return {entry["id"] for entry in response.json()["data"]}
    return None


def _wait(condition: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def summarize(
    outcomes: list[Outcome],
    loads: dict[str, float],
    seconds: float,
    *,
    warmup: float = 0.0,
    warm_loads: dict[str, float] | None = None,
) -> AdapterRun:
    """Every number of one run; the ``steady`` ones count requests sent after ``warmup``
    and the loads since then."""
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    steady = [o for o in outcomes if o.offset >= warmup]
    steady_ttfts = [o.ttft for o in steady if o.ttft is not None]
    total_loads = sum(loads.values())
    steady_loads = total_loads - sum((warm_loads or {}).values())
    served: dict[str, int] = {}
    for outcome in outcomes:
        served[outcome.replica] = served.get(outcome.replica, 0) + 1
    return AdapterRun(
        requests=len(outcomes),
        errors=sum(1 for o in outcomes if o.status != 200),
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        adapter_loads=total_loads,
        loads_per_1000=1000 * total_loads / max(1, len(outcomes)),
        steady=Steady(
            requests=len(steady),
            ttft_p50=percentile(steady_ttfts, 50),
            ttft_p99=percentile(steady_ttfts, 99),
            loads=steady_loads,
            loads_per_1000=1000 * steady_loads / max(1, len(steady)),
        ),
        loads_by_replica=loads,
        served_by_replica=dict(sorted(served.items())),
        seconds=round(seconds, 1),
    )


def run_adapters(config: AdaptersConfig, *, state_dir: Path | None = None) -> Path:
    """Run every policy of `config` and write the report; returns the Markdown report's path."""
    from bench.adapters.report import markdown

    state = state_dir or Path(tempfile.mkdtemp(prefix="kvpilot-bench-adapters-"))
    plan = arrivals(config)
    names = adapter_names(config)
    results: dict[str, AdapterRun] = {}
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(
            local_stack(state, node_id="bench-envoy", etcd_args=["--unsafe-no-fsync"])
        )
        backends = stack.enter_context(
            BackendProcess(
                config.replicas,
                id_prefix="replica",
                model=BASE,
                state_dir=state / "backends",
                simulator=config.sim,
                lora={
                    "catalog": names,
                    "maxLoaded": config.max_loaded,
                    "loadTime": config.load_time,
                },
            ).start()
        )
        agent = start_agent(
            state / "agent",
            local.etcd.endpoint,
            [replica.url for replica in backends.replicas],
            pool=POOL,
            interval=config.agent_interval,
            max_running=config.sim.max_batch,
        )
        stack.callback(agent.stop)
        from api.client import KvpilotClient

        client = KvpilotClient(local.kvpilot.api_url, token=local.admin_token)
        listener_port = free_port()
        client.put(
            {
                "apiVersion": "kvpilot.io/v1",
                "kind": "Pool",
                "metadata": {"name": POOL},
                "spec": {
                    "endpoints": [
                        {"address": r.host, "port": r.port, "name": r.id} for r in backends.replicas
                    ],
                    "healthCheck": {"path": "/health", "interval": "1s", "timeout": "500ms"},
                },
            }
        )
        client.put(
            {
                "apiVersion": "kvpilot.io/v1",
                "kind": "Fleet",
                "metadata": {"name": "default"},
                "spec": {"accessLog": False},
            }
        )
        for key in config.policies:
            say(f"adapters: {key}: resetting replicas")
            for replica in backends.replicas:
                backends.adapters(replica.id, unload=names)
            backends.reset()
            client.put(
                {
                    "apiVersion": "kvpilot.io/v1",
                    "kind": "RoutingPolicy",
                    "metadata": {"name": "bench"},
                    "spec": {
                        "listener": {"address": "127.0.0.1", "port": listener_port},
                        "routes": [
                            {
                                "name": "chat",
                                "match": {"poolModels": True},
                                "tiers": [[POOL]],
                                **POLICIES[key],
                            }
                        ],
                    },
                }
            )
            # Served, and no adapter left over from the run before in the agents' reports.
            _wait(lambda: _listed(listener_port) == {BASE}, 60, f"Envoy to serve {key}")
            time.sleep(2 * config.agent_interval)
            backends.reset()
            say(f"adapters: {key}: {config.requests} requests at {config.rate:g}/s")
            started = time.monotonic()
            outcomes, warm_loads = asyncio.run(
                replay(
                    chat_url(listener_port),
                    plan,
                    config.max_tokens,
                    warmup=config.warmup,
                    at_warmup=lambda: _loads(backends),
                )
            )
            seconds = time.monotonic() - started
            results[key] = summarize(
                outcomes,
                _loads(backends),
                seconds,
                warmup=config.warmup,
                warm_loads=warm_loads,
            )
            say(
                f"adapters: {key}: TTFT p99 {results[key].ttft_p99:.3f}s, "
                f"{results[key].loads_per_1000:.0f} loads per 1000 requests"
            )
    config.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = config.out_dir / f"adapters-{stamp}.md"
    settings = asdict(replace(config, out_dir=Path(str(config.out_dir))))
    settings["out_dir"] = str(config.out_dir)
    document = {"config": settings, "results": {k: r.to_json() for k, r in results.items()}}
    report.with_suffix(".json").write_text(json.dumps(document, indent=2, default=str))
    report.write_text(markdown(config, results))
    return report
