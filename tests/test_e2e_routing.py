"""Routing features proven with real traffic: REST API -> etcd -> kvpilot -> ADS -> Envoy -> replicas.

Each test applies a policy through the REST API, waits until Envoy's health checks pass on the
replicas it expects, then sends requests through Envoy and asserts on which replica answered
(`x-backend-id`). One kvpilot and one Envoy per test; design.md lists the Envoy behaviours
these tests pin down. Failover has its own module, test_e2e_failover.
"""

from __future__ import annotations

import collections
import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool
from harness.gated_backend import STREAM_CHUNKS, hold_one_by_one, stream_piece
from harness.rig import Rig, ports_of
from harness.traffic import Traffic, answered_by, send
from harness.wait import wait_until

pytestmark = pytest.mark.e2e


# --------------------------------------------------------------------------- session affinity


def lb_policy(rig: Rig, cluster: str) -> str:
    """The load-balancing policy Envoy runs `cluster` with, from its config dump."""
    for config in rig.envoy.config_dump()["configs"]:
        for entry in config.get("dynamic_active_clusters", []):
            if entry["cluster"]["name"] == cluster:
                return str(entry["cluster"].get("lb_policy", "ROUND_ROBIN"))
    raise AssertionError(f"Envoy has no cluster {cluster}")


@pytest.mark.parametrize("algorithm", ["ring_hash", "maglev"])
def test_each_session_sticks_to_one_replica_and_sessions_spread(
    rig: Rig, backends: Any, algorithm: str
) -> None:
    replicas = backends(3, id_prefix="aff")
    ports = ports_of(replicas)
    affinity = {"algorithm": algorithm}
    rig.apply(
        pool("llm", ports, health_check=FAST_HEALTH_CHECK),
        policy(
            "chat",
            rig.listener_port,
            [{"name": "all", "sessionAffinity": affinity, "tiers": [["llm"]]}],
        ),
    )
    rig.wait_ready("chat/all", ports)
    rig.wait_ready("chat/all/affinity", ports)
    assert lb_policy(rig, "chat/all/affinity") == algorithm.upper()

    # 24 sessions on a ring shared by 3 replicas: all on one replica has probability < 1e-9.
    sessions = [f"session-{index}" for index in range(24)]
    landed: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with httpx.Client(timeout=30) as client:
        for turn in range(3):
            for session in sessions:
                response = client.post(
                    rig.url(),
                    json=chat(content=f"{session} turn {turn}"),
                    headers={"x-session-id": session},
                )
                assert response.status_code == 200, response.text
                landed[session][answered_by(response)] += 1
        unpinned = send(client, rig.url(), 60)

    assert all(len(replica) == 1 for replica in landed.values()), dict(landed)
    homes = collections.Counter(next(iter(replica)) for replica in landed.values())
    assert len(homes) > 1, homes
    # Without the header the route's own balancing (least request) applies: every replica
    # serves some of 60 requests (one left out has probability < 1e-10).
    assert {status for status, _ in unpinned} == {200}
    assert {replica for _, replica in unpinned} == {r.id for r in replicas.replicas}


def test_a_hot_session_spreads_under_bounded_load(rig: Rig, gated: Any) -> None:
    replicas = gated(3, id_prefix="hot")
    ports = list(replicas.ports.values())
    affinity = {"header": "x-session-id", "hashBalanceFactor": 150}
    rig.apply(
        pool("llm", ports, health_check=FAST_HEALTH_CHECK),
        policy(
            "chat",
            rig.listener_port,
            [{"name": "all", "sessionAffinity": affinity, "tiers": [["llm"]]}],
        ),
    )
    rig.wait_ready("chat/all/affinity", ports)
    # The session's own replica (its point on the ring), while nothing is in flight.
    home = answered_by(
        httpx.post(rig.url(), json=chat(), headers={"x-session-id": "hot-session"}, timeout=60)
    )

    total = 40
    # One client shared by the threads (a new client per request costs an SSL context each).
    limits = httpx.Limits(max_connections=total + 5)
    with httpx.Client(limits=limits) as client:
        held, responses = hold_one_by_one(
            replicas,
            total,
            lambda index: client.post(
                rig.url(),
                json=chat(content=f"turn {index}"),
                headers={"x-session-id": "hot-session"},
                timeout=600,
            ),
        )

    assert [response.status_code for response in responses] == [200] * total
    assert collections.Counter(answered_by(r) for r in responses) == collections.Counter(held)
    # Without bounded load all 40 go to the session's replica (design.md). With a factor of
    # 150% Envoy places a request on a replica only while it holds at most 1.5x the average
    # in flight, so none ends above that plus one. Arriving one by one, the requests fill the
    # session's replica to the bound and spill to the next on the ring (21/19/0 was seen;
    # concurrent arrivals spread wider, 16/16/8 in design.md).
    assert len([count for count in held.values() if count]) > 1, held
    assert max(held.values()) <= math.ceil(1.5 * total / 3) + 1, held
    # The session's replica is filled first: it takes a request while it holds at most
    # ceil(1.5 * (in flight + 1) / 3), which arriving one by one is every other request, so
    # it ends with about half of them. Plain round robin would leave it 13 or 14.
    assert held[home] == max(held.values()), (home, held)
    assert held[home] >= total // 2 - 1, (home, held)


def test_least_request_takes_the_replica_with_the_fewest_in_flight_of_all(
    rig: Rig, gated: Any
) -> None:
    """The default balancing compares every replica (Envoy's full scan), not two drawn at
    random with replacement (which left eight requests on four replicas at 1/3/1/3 and
    2/1/2/3 in two runs of three): twelve requests held on four, three each, whatever the
    order."""
    replicas = gated(4, id_prefix="spread")
    ports = list(replicas.ports.values())
    rig.apply(
        pool("llm", ports, health_check=FAST_HEALTH_CHECK),
        policy("chat", rig.listener_port, [{"name": "all", "tiers": [["llm"]]}]),
    )
    rig.wait_ready("chat/all", ports)
    assert lb_policy(rig, "chat/all") == "LEAST_REQUEST"

    def one(index: int) -> int:
        return httpx.post(rig.url(), json=chat(content=f"request {index}"), timeout=600).status_code

    held, statuses = hold_one_by_one(replicas, 12, one)
    assert sorted(held.values()) == [3, 3, 3, 3], held
    assert statuses == [200] * 12


# --------------------------------------------------------------------------- weighted split


def test_a_90_10_split_holds_under_concurrent_clients(rig: Rig, backends: Any) -> None:
    stable = backends(2, id_prefix="stable")
    canary = backends(2, id_prefix="canary")
    split = [{"pool": "stable", "weight": 90}, {"pool": "canary", "weight": 10}]
    rig.apply(
        pool("stable", ports_of(stable), health_check=FAST_HEALTH_CHECK),
        pool("canary", ports_of(canary), health_check=FAST_HEALTH_CHECK),
        policy("chat", rig.listener_port, [{"name": "all", "tiers": [split]}]),
    )
    rig.wait_ready("chat/all", ports_of(stable) + ports_of(canary))

    # Eight clients at once under least request (the default balancing): with the split as
    # endpoint weights alone, each host's weight is divided by its requests in flight, and the
    # less loaded canary drew 17.7%. Pools are localities weighted by their share, which
    # Envoy picks on a deterministic weighted schedule: the share holds to within a point,
    # tighter than chance alone would allow (a binomial 2,000 draws spans 6.9%-13.5%).
    total = 2000
    with Traffic(rig.url(), workers=8) as traffic:
        traffic.wait_for(total, timeout=120)
    results = traffic.results
    assert {status for status, _ in results} == {200}
    share = sum(replica.startswith("canary-") for _, replica in results) / len(results)
    print(f"canary share {share:.2%} of {len(results)} requests from 8 clients")
    assert 0.09 <= share <= 0.11, f"canary share {share:.2%}, weight 10%"


# --------------------------------------------------------------------------- model routing


def test_the_model_field_or_header_selects_the_pool(rig: Rig, backends: Any) -> None:
    llama = backends(1, id_prefix="llama", model="llama-3")
    qwen = backends(1, id_prefix="qwen", model="qwen-7b")
    rig.apply(
        pool("llama", ports_of(llama), models=["llama-3"], health_check=FAST_HEALTH_CHECK),
        pool("qwen", ports_of(qwen), models=["qwen-7b"], health_check=FAST_HEALTH_CHECK),
        policy(
            "chat",
            rig.listener_port,
            [
                {"name": "llama", "match": {"models": ["llama-3"]}, "tiers": [["llama"]]},
                {"name": "qwen", "match": {"models": ["qwen-7b"]}, "tiers": [["qwen"]]},
            ],
        ),
    )
    rig.wait_ready("chat/llama", ports_of(llama))
    rig.wait_ready("chat/qwen", ports_of(qwen))

    json_utf8 = {"content-type": "application/json; charset=utf-8"}
    # Two million characters of prompt, with `model` after them: the filter must read the
    # whole body, beyond Envoy's default 1 MiB buffer.
    long_prompt = {"messages": [{"role": "user", "content": "x" * 2_000_000}], "model": "qwen-7b"}
    cases: list[tuple[str, dict[str, str], bytes, str]] = [
        ("body field", {"content-type": "application/json"}, body(chat("llama-3")), "llama-0"),
        ("body field", {"content-type": "application/json"}, body(chat("qwen-7b")), "qwen-0"),
        ("charset=utf-8", json_utf8, body(chat("qwen-7b")), "qwen-0"),
        ("no content-type", {}, body(chat("llama-3")), "llama-0"),
        ("header overrides body", {"x-model": "qwen-7b"}, body(chat("llama-3")), "qwen-0"),
        ("header overrides body", {"x-model": "llama-3"}, body(chat("qwen-7b")), "llama-0"),
        ("2 MB prompt", json_utf8, body(long_prompt), "qwen-0"),
        # Media types are case-insensitive and parameters come in any spacing (Spring sends
        # the fourth): one matcher in Envoy takes them all.
        *[
            (ct, {"content-type": ct}, body(chat("qwen-7b")), "qwen-0")
            for ct in (
                "application/json;charset=utf-8",
                "application/json; charset=UTF-8",
                "application/json;charset=UTF-8",
                "Application/JSON",
                "application/json ; charset=utf-8",
                'APPLICATION/JSON;  Charset="utf-8"',
            )
        ],
    ]
    with httpx.Client(timeout=30) as client:
        for name, headers, content, expected in cases:
            response = client.post(rig.url(), content=content, headers=headers)
            assert (response.status_code, answered_by(response)) == (200, expected), name

        unknown = client.post(rig.url(), json=chat("gpt-9"))
        # The header wins even when it names a model nobody serves.
        overridden = client.post(rig.url(), json=chat("llama-3"), headers={"x-model": "gpt-9"})
    assert overridden.status_code == 404, overridden.text
    assert unknown.status_code == 404
    assert unknown.headers["content-type"] == "application/json"
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert error["type"] == "invalid_request_error" and error["message"], error


def body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


# --------------------------------------------------------------------------- streaming


def test_sse_streams_pass_through_as_they_come_and_intact(rig: Rig, gated: Any) -> None:
    replicas = gated(1, id_prefix="stream")
    ports = list(replicas.ports.values())
    rig.apply(
        pool("llm", ports, models=["stream-model"], health_check=FAST_HEALTH_CHECK),
        policy(
            "chat",
            rig.listener_port,
            [{"name": "all", "match": {"models": ["stream-model"]}, "tiers": [["llm"]]}],
        ),
    )
    rig.wait_ready("chat/all", ports)

    replicas.set_gate(False)
    events: list[str] = []
    try:
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", rig.url(), json=chat("stream-model", stream=True)) as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-backend-id"] == "stream-0"
            lines = response.iter_lines()
            # The replica sends two chunks and then waits for the gate: they reach the client
            # only if Envoy forwards chunks as they come instead of buffering the response.
            while len(events) < 2:
                line = next(lines)
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
            replicas.set_gate(True)
            events += [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    finally:
        replicas.set_gate(True)

    assert events[-1] == "[DONE]", events
    pieces = [json.loads(event)["choices"][0]["delta"]["content"] for event in events[:-1]]
    assert pieces == [stream_piece(index) for index in range(STREAM_CHUNKS)]


# --------------------------------------------------------------------------- circuit breakers


def test_requests_over_the_circuit_breaker_limit_fail_fast(rig: Rig, gated: Any) -> None:
    replicas = gated(1, id_prefix="cb")
    ports = list(replicas.ports.values())
    rig.apply(
        pool("llm", ports, circuitBreakers={"maxRequests": 2}, health_check=FAST_HEALTH_CHECK),
        policy("chat", rig.listener_port, [{"name": "all", "tiers": [["llm"]]}]),
    )
    rig.wait_ready("chat/all", ports)

    replicas.set_gate(False)
    with ThreadPoolExecutor(max_workers=2) as executor:
        try:
            held = [
                executor.submit(
                    httpx.post, rig.url(), json=chat(content=f"held {index}"), timeout=60
                )
                for index in range(2)
            ]
            wait_until(lambda: replicas.in_flight() == {"cb-0": 2}, 30, message="2 requests held")
            # At the limit Envoy answers at once instead of queueing behind the held requests.
            # (Whether it waits for a connection first depends on the worker thread that takes
            # it; either way it never reaches the replica.)
            overflow = httpx.post(rig.url(), json=chat(content="over"), timeout=30)
            assert overflow.status_code == 503, overflow.text
            assert overflow.headers.get("x-envoy-overloaded") == "true", overflow.headers
            # In OpenAI's error format, with Envoy's reason for an operator.
            error = overflow.json()["error"]
            assert error["type"] == "server_error", error
            assert error["code"] == "upstream_reset_before_response_started{overflow}", error
            assert replicas.in_flight() == {"cb-0": 2}
        finally:
            replicas.set_gate(True)
        answers = [future.result() for future in held]

    assert [(r.status_code, answered_by(r)) for r in answers] == [(200, "cb-0")] * 2
    stats = rig.envoy.stats()
    overflows = {name: value for name, value in stats.items() if "overflow" in name}
    assert overflows["cluster.chat/all.upstream_rq_active_overflow"] == 1, overflows


def test_a_pool_without_replicas_answers_503_in_openai_error_format(rig: Rig) -> None:
    rig.apply(
        pool(
            "llm", [], health_check=FAST_HEALTH_CHECK
        ),  # replicas register themselves later; none has yet
        policy("chat", rig.listener_port, [{"name": "all", "tiers": [["llm"]]}]),
    )

    def unavailable() -> httpx.Response | None:
        response = httpx.post(rig.url(), json=chat(), timeout=30)
        return response if response.status_code == 503 else None

    response = wait_until(unavailable, 30, message="Envoy to answer for the empty pool")
    assert response.headers["content-type"] == "application/json", response.headers
    assert response.json() == {
        "error": {
            "message": "no healthy upstream",
            "type": "server_error",
            "param": None,
            "code": "no_healthy_upstream",
        }
    }


# --------------------------------------------------------------------------- route timeouts


def test_a_request_past_the_route_timeout_is_ended_by_envoy(rig: Rig, backends: Any) -> None:
    replicas = backends(1, id_prefix="slow")
    ports = ports_of(replicas)
    [replica] = replicas.replicas
    httpx.post(f"{replica.url}/admin/slow", json={"delay": 1.5}, timeout=10).raise_for_status()

    def apply(request_timeout: str) -> None:
        route = {"name": "all", "tiers": [["llm"]], "timeouts": {"request": request_timeout}}
        rig.apply(
            pool("llm", ports, health_check=FAST_HEALTH_CHECK),
            policy("chat", rig.listener_port, [route]),
        )

    # A replica that answers after 1.5 s, behind a route that allows 0.5 s: Envoy answers 504.
    apply("500ms")
    rig.wait_ready("chat/all", ports)
    with httpx.Client(timeout=30) as client:
        response = client.post(rig.url(), json=chat())
        assert response.status_code == 504, response.text
        assert "x-backend-id" not in response.headers  # Envoy ended it, not the replica
        # The same route allowing 10 s: the answer arrives.
        apply("10s")
        wait_until(
            lambda: client.post(rig.url(), json=chat()).status_code == 200,
            60,
            message="the longer timeout to reach Envoy and the answer to arrive",
        )
        response = client.post(rig.url(), json=chat())
        assert response.status_code == 200 and answered_by(response) == replica.id
