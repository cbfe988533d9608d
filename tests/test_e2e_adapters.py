"""Models and LoRA adapters discovered by the agent, end to end: simulated vLLM replicas that
load and unload adapters -> `kvpilot agent` -> etcd -> kvpilot -> a real Envoy.

The pool lists no models: the route matches what the replicas report (``poolModels``), and
a request for an adapter goes to the replicas that have it loaded (subset load balancing on
the endpoints' reported models).
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.agent import agent_running
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool, route
from harness.rig import BackendFactory, Rig, ports_of
from harness.traffic import answered_by
from harness.wait import wait_until

from controlplane.local import EmbeddedEtcd
from replicasim.replica import DEFAULT_MODEL

pytestmark = pytest.mark.e2e

CATALOG = ["sql", "chat", "poem"]


def served(rig: Rig, model: str, count: int, **headers: str) -> collections.Counter[str]:
    """Which replica answered each of `count` requests for `model` (status-N: Envoy's own)."""
    with httpx.Client(timeout=10) as client:
        return collections.Counter(
            answered_by(
                client.post(rig.url(), json=chat(content=str(i), model=model), headers=headers)
            )
            for i in range(count)
        )


def listed(rig: Rig) -> dict[str, Any]:
    """GET /v1/models through Envoy: id -> entry."""
    response = httpx.get(rig.url("/v1/models"), timeout=5)
    response.raise_for_status()
    return {entry["id"]: entry for entry in response.json()["data"]}


def adapter_policy(rig: Rig, *, fallback: str = "base", **fields: Any) -> dict[str, Any]:
    return policy(
        "web",
        rig.listener_port,
        [
            route(
                "llama",
                match={"poolModels": True},
                adapters={"fallback": fallback},
                **fields,
            )
        ],
    )


def endpoint_rows(rig: Rig) -> dict[int, dict[str, Any]]:
    """The console's view of pool llama's endpoints, by port."""
    pools = rig.api.get("/v1/endpoints").json()["pools"]
    return {row["port"]: row for p in pools if p["name"] == "llama" for row in p["endpoints"]}


@pytest.mark.parametrize("affinity", [False, True], ids=["least-request", "session-affinity"])
def test_an_adapter_goes_to_the_replicas_that_have_it_loaded(
    rig: Rig,
    backends: BackendFactory,
    etcd: EmbeddedEtcd,
    etcd_prefix: str,
    tmp_path: Path,
    affinity: bool,
) -> None:
    replicas = backends(4, lora={"catalog": CATALOG, "loadTime": 0.05})
    ports = ports_of(replicas)
    ids = [r.id for r in replicas.replicas]
    for replica_id in ids[:2]:
        replicas.adapters(replica_id, load=["sql"])
    fields: dict[str, Any] = {"sessionAffinity": {}} if affinity else {}
    rig.apply(
        pool("llama", ports, health_check=FAST_HEALTH_CHECK),
        adapter_policy(rig, fallback="notFound", **fields),
    )
    urls = [r.url for r in replicas.replicas]
    with agent_running(etcd.endpoint, etcd_prefix, "llama", urls, log=tmp_path / "agent.log"):
        rig.wait_ready("web/all", ports)
        wait_until(lambda: "sql" in listed(rig), 30, message="sql in GET /v1/models")
        assert listed(rig)["sql"]["parent"] == DEFAULT_MODEL
        assert set(listed(rig)) == {DEFAULT_MODEL, "sql"}

        # Loaded on 2 of 4: every request for it lands on those 2, with or without a
        # session (each request its own session id: the ring within the subset).
        sessions = {"x-session-id": "s"} if affinity else {}
        counts = served(rig, "sql", 40, **sessions)
        assert set(counts) <= set(ids[:2]), counts
        assert sum(counts.values()) == 40
        if affinity:
            # One session stays on one replica of the two.
            assert len(counts) == 1, counts
        # The base model is unaffected: all four replicas take it.
        base = served(rig, DEFAULT_MODEL, 60)
        assert set(base) == set(ids), base

        # Loaded on a third: it joins within seconds of the agent's scrape that saw it.
        replicas.adapters(ids[2], load=["sql"])
        scraped = wait_until(
            lambda: (
                (row := endpoint_rows(rig)[ports[2]])["adapters"] == ["sql"]
                and row["telemetry"]["at"]
            ),
            30,
            message="the agent's record of sql on the third replica",
        )

        def joined() -> bool:
            with httpx.Client(timeout=10) as client:
                for i in range(12):
                    headers = {"x-session-id": f"join-{time.monotonic()}-{i}"} if affinity else {}
                    response = client.post(
                        rig.url(), json=chat(content=f"j{i}", model="sql"), headers=headers
                    )
                    if answered_by(response) == ids[2]:
                        return True
            return False

        wait_until(joined, 30, interval=0.02, message="the third replica to take sql")
        took = time.time() - scraped
        print(f"adapter joined {took:.2f}s after the agent's scrape that saw it")
        counts = served(rig, "sql", 60)
        assert set(counts) <= set(ids[:3]) and ids[2] in counts, counts

        # Unloaded everywhere: with fallback notFound, Envoy answers OpenAI's 404.
        for replica_id in ids[:3]:
            replicas.adapters(replica_id, unload=["sql"])
        wait_until(lambda: "sql" not in listed(rig), 30, message="sql gone from /v1/models")
        response = httpx.post(rig.url(), json=chat(model="sql"), timeout=10)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"

        # With fallback base, the base model's replicas take it and load it on demand.
        rig.apply(adapter_policy(rig, fallback="base", **fields))
        wait_until(
            lambda: answered_by(httpx.post(rig.url(), json=chat(model="sql"), timeout=10)) in ids,
            30,
            message="the base fallback to serve sql",
        )
        # A name no replica can load: the replica's own 404, through the fallback.
        response = httpx.post(rig.url(), json=chat(model="nonesuch"), timeout=10)
        assert response.status_code == 404 and answered_by(response) in ids


def test_a_replica_whose_model_list_breaks_keeps_its_models_and_shows_in_status(
    rig: Rig,
    metrics_backends: Any,
    etcd: EmbeddedEtcd,
    etcd_prefix: str,
    tmp_path: Path,
) -> None:
    backends = [metrics_backends(f"mb-{i}") for i in range(2)]
    for backend in backends:
        backend.models = {"data": [{"id": "qwen", "object": "model"}]}
    rig.apply(
        pool("llama", [b.port for b in backends], health_check=FAST_HEALTH_CHECK),
        adapter_policy(rig, fallback="notFound"),
    )
    urls = [b.url for b in backends]
    with agent_running(etcd.endpoint, etcd_prefix, "llama", urls, log=tmp_path / "agent.log"):
        rig.wait_ready("web/all", [b.port for b in backends])
        wait_until(lambda: "qwen" in listed(rig), 30, message="qwen in GET /v1/models")
        backends[0].models_status = 500

        def reported() -> list[dict[str, Any]]:
            return rig.api.get("/v1/status").json()["unreadModelLists"]

        unread = wait_until(reported, 30, message="the broken model list in /v1/status")
        assert unread[0]["endpoint"] == f"127.0.0.1:{backends[0].port}"
        assert unread[0]["models"] == ["qwen"] and "500" in unread[0]["error"]
        # Routing keeps the last list read: both replicas still take qwen.
        with httpx.Client(timeout=10) as client:
            counts = collections.Counter(
                answered_by(client.post(rig.url(), json=chat(content=str(i), model="qwen")))
                for i in range(30)
            )
        assert set(counts) == {"mb-0", "mb-1"}, counts
        backends[0].models_status = 200
        wait_until(lambda: not reported(), 30, message="status to clear")
