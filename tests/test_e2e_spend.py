"""Token accounting end to end: simulated vLLM replicas -> a real Envoy whose Lua filter reads
each response's usage -> the access log service of a real `kvpilot serve` -> etcd -> the
REST view, Prometheus, and a restarted replica that continues from what it stored."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from datetime import datetime
from decimal import Decimal
from typing import Any

import httpx
import pytest
from harness.auth import READ_TOKEN
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool, route
from harness.rig import BackendFactory, KvpilotFactory, Rig, api_client, ports_of
from harness.wait import wait_until

from bench.simulator import SimConfig
from commands.cli import main as cli_main
from controlplane.launchers import free_port

pytestmark = pytest.mark.e2e

PRICE = {"currency": "USD", "input": "2.50", "cachedInput": "1.25", "output": "10"}
"""The paid pool's price per million tokens."""
FAST_SIM = SimConfig(stream_interval=0.01)


def spend_policy(port: int) -> dict[str, Any]:
    return policy(
        "web",
        port,
        [
            route("paid", name="paid", match={"models": ["m-paid"]}),
            route("owned", name="owned", match={"models": ["m-owned"]}),
        ],
    )


def start(rig: Rig, backends: BackendFactory) -> tuple[Any, Any]:
    paid = backends(2, id_prefix="paid", model="m-paid", simulator=FAST_SIM)
    owned = backends(1, id_prefix="owned", model="m-owned", simulator=FAST_SIM)
    rig.apply(
        pool(
            "paid",
            ports_of(paid),
            models=["m-paid"],
            health_check=FAST_HEALTH_CHECK,
            price=PRICE,
        ),
        pool(
            "owned",
            ports_of(owned),
            models=["m-owned"],
            health_check=FAST_HEALTH_CHECK,
            price={"replicaHour": "4.20"},
        ),
        spend_policy(rig.listener_port),
    )
    rig.wait_ready("web/paid", ports_of(paid))
    rig.wait_ready("web/owned", ports_of(owned))
    return paid, owned


def events(text: str) -> list[Any]:
    """The JSON events of an SSE body (``[DONE]`` left out)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def send_mixed(rig: Rig, rounds: int) -> tuple[Counter[str], list[dict[str, Any]]]:
    """Requests of three tenants to two models: JSON, streams that ask for usage and streams
    that do not; the same prompts come back (prefix cache hits). Returns requests per tenant
    and the usage blocks the clients saw."""
    sent: Counter[str] = Counter()
    seen: list[dict[str, Any]] = []
    with httpx.Client(timeout=30) as client:
        for i in range(rounds):
            for tenant in ("acme", "globex", "initech"):
                for model in ("m-paid", "m-owned"):
                    content = f"{tenant} asks about item {i % 3} " + "with context " * (5 + i % 4)
                    headers = {"x-tenant-id": tenant}
                    kind = i % 3
                    body = chat(model, content, max_tokens=4 + i % 5)
                    if kind == 1:
                        body |= {"stream": True, "stream_options": {"include_usage": True}}
                    elif kind == 2:
                        body |= {"stream": True}
                    response = client.post(rig.url(), json=body, headers=headers)
                    assert response.status_code == 200, response.text
                    sent[tenant] += 1
                    if kind == 0:
                        seen.append(response.json()["usage"])
                    elif kind == 1:
                        usage = [e["usage"] for e in events(response.text) if e.get("usage")]
                        assert len(usage) == 1
                        seen.append(usage[0])
                    else:
                        # The client did not ask for usage: Envoy asked for it and took the
                        # usage event out again, so the stream is what it would have been.
                        chunks = events(response.text)
                        assert chunks and all(c["choices"] for c in chunks), response.text
                        assert not any("usage" in c for c in chunks)
    return sent, seen


def replica_totals(process: Any) -> Counter[str]:
    """The replicas' own counters (what vLLM would export)."""
    out: Counter[str] = Counter()
    for replica in process.replicas:
        for line in httpx.get(f"{replica.url}/metrics", timeout=5).text.splitlines():
            name, _, value = line.partition(" ")
            name = name.split("{", 1)[0]
            for kind, metric in (
                ("prompt", "vllm:prompt_tokens_total"),
                ("completion", "vllm:generation_tokens_total"),
                ("cached", "vllm:prefix_cache_hits_total"),
                ("requests", "vllm:request_success_total"),
            ):
                if name == metric:
                    out[kind] += int(float(value))
    return out


def spend(rig: Rig, **params: str) -> dict[str, Any]:
    response = rig.api.get("/v1/spend", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def by(rig: Rig, field: str, **params: str) -> dict[str, Counter[str]]:
    """Counters summed by one field (rows are also split by currency)."""
    out: dict[str, Counter[str]] = {}
    for row in spend(rig, by=field, **params)["rows"]:
        counts = out.setdefault(row[field], Counter())
        for name, value in row.items():
            if isinstance(value, int) and name != field:
                counts[name] += value
    return out


def pool_rows(rig: Rig) -> dict[str, Counter[str]]:
    return by(rig, "pool")


def wait_counted(rig: Rig, requests: int) -> None:
    wait_until(
        lambda: sum(row["requests"] for row in pool_rows(rig).values()) >= requests,
        30,
        message=f"kvpilot to count {requests} responses",
    )


def test_usage_of_every_response_equals_the_replicas_own_counts(
    rig: Rig, backends: BackendFactory
) -> None:
    paid, owned = start(rig, backends)
    sent, seen = send_mixed(rig, rounds=6)
    total = sum(sent.values())
    wait_counted(rig, total)
    rows = pool_rows(rig)
    for name, process in (("paid", paid), ("owned", owned)):
        own = replica_totals(process)
        row = rows[name]
        assert row["requests"] == own["requests"] == total // 2
        assert row["promptTokens"] == own["prompt"]
        assert row["completionTokens"] == own["completion"]
        assert row["cachedTokens"] == own["cached"]
    assert rows["paid"]["cachedTokens"] > 0, "the repeated prompts should hit the prefix cache"
    by_tenant = by(rig, "tenant")
    assert {t: row["requests"] for t, row in by_tenant.items()} == dict(sent)
    # The usage blocks the clients saw are a part of what was counted.
    assert sum(u["completion_tokens"] for u in seen) <= sum(
        row["completionTokens"] for row in by_tenant.values()
    )
    by_model = {model: row["requests"] for model, row in by(rig, "model").items()}
    assert by_model == {"m-paid": total // 2, "m-owned": total // 2}


def test_dollars_equal_tokens_times_the_pools_price(
    rig: Rig, backends: BackendFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    start(rig, backends)
    sent, _ = send_mixed(rig, rounds=3)
    wait_counted(rig, sum(sent.values()))
    rows = spend(rig, by="tenant,pool")["rows"]
    million = Decimal(1_000_000)
    for row in rows:
        if row["pool"] != "paid":
            assert row["currency"] == "" and Decimal(row["cost"]) == 0
            continue
        uncached = row["promptTokens"] - row["cachedTokens"]
        expected = (
            uncached * Decimal(PRICE["input"])
            + row["cachedTokens"] * Decimal(PRICE["cachedInput"])
            + row["completionTokens"] * Decimal(PRICE["output"])
        ) / million
        assert row["currency"] == "USD"
        assert Decimal(row["cost"]) == expected
    metrics = httpx.get(f"{rig.kvpilot.api_url}/metrics", timeout=5).text
    exported = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvpilot_spend_total{") and 'pool="paid"' in line
    )
    assert exported == pytest.approx(
        float(sum(Decimal(r["cost"]) for r in rows if r["pool"] == "paid")), rel=1e-9
    )
    # The CLI shows the same numbers, and the pools' prices.
    total_paid = sum(Decimal(r["cost"]) for r in rows if r["pool"] == "paid")
    server = ["--server", rig.kvpilot.api_url, "--token", READ_TOKEN]
    assert cli_main(["get", "spend", "--by", "pool", *server]) == 0
    shown = capsys.readouterr().out
    assert f"{total_paid} USD" in shown and "replica-hour x1" in shown
    assert cli_main(["get", "pools", *server]) == 0
    shown = capsys.readouterr().out
    assert "USD 2.5/10 per 1M (cached 1.25)" in shown and "USD 4.2/replica-hour" in shown


def test_a_restarted_replica_continues_from_the_spend_it_stored(
    etcd_prefix: str,
    kvpilot_factory: KvpilotFactory,
    envoy_factory: Any,
    backends: BackendFactory,
) -> None:
    kvpilot = kvpilot_factory(etcd_prefix, extra_args=["--replica-id", "spend-a"])
    envoy = envoy_factory(xds_port=kvpilot.xds_port, fleet="default")
    rig = Rig.around(kvpilot, envoy)
    with rig.api:
        start(rig, backends)
        first, _ = send_mixed(rig, rounds=3)
        wait_counted(rig, sum(first.values()))
        before = spend(rig, window="minute", by="tenant")
        kvpilot.stop()
        kvpilot.start()
        # Nothing lost across the restart, in the totals and in the current window (unless
        # the minute turned meanwhile).
        after = by(rig, "tenant")
        assert {tenant: row["requests"] for tenant, row in after.items()} == dict(first)
        current = spend(rig, window="minute", by="tenant")
        if current["start"] == before["start"]:
            assert current["rows"] == before["rows"]
        # Envoy reconnects its access log stream, and counting goes on from the stored totals.
        second, _ = send_mixed(rig, rounds=3)
        wait_counted(rig, sum(first.values()) + sum(second.values()))
        final = {tenant: row["requests"] for tenant, row in by(rig, "tenant").items()}
        assert final == dict(first + second)


def budget(name: str, tenant: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Budget",
        "metadata": {"name": name},
        "spec": {"tenant": tenant, **spec},
    }


def test_a_tenant_past_its_budget_gets_429_with_retry_after_and_others_do_not(
    rig: Rig, backends: BackendFactory
) -> None:
    start(rig, backends)
    rig.apply(budget("acme-hourly", "acme", window="hour", amount="0.0002", currency="USD"))
    url = rig.url()
    with httpx.Client(timeout=30) as client:

        def ask(tenant: str) -> httpx.Response:
            return client.post(
                url,
                json=chat("m-paid", "tell me more", max_tokens=16),
                headers={"x-tenant-id": tenant},
            )

        refused: list[httpx.Response] = []

        def spent() -> bool:
            response = ask("acme")
            if response.status_code == 429:
                refused.append(response)
                return True
            assert response.status_code == 200, response.text
            return False

        wait_until(spent, 60, message="acme to be refused past its budget")
        answer = refused[0]
        error = answer.json()["error"]
        assert error["code"] == "budget_exceeded"
        assert error["type"] == "insufficient_quota"
        assert "acme-hourly" in error["message"]
        view = spend(rig, window="hour", by="tenant")
        end = datetime.fromisoformat(view["end"].replace("Z", "+00:00")).timestamp()
        retry_after = int(answer.headers["retry-after"])
        assert 0 < retry_after <= end - time.time() + 2
        assert answer.headers["x-kvpilot-budget"] == "acme-hourly"
        # Other tenants, and the model of another pool, are not affected.
        assert ask("globex").status_code == 200
        # Raising the budget lets the tenant in again.
        rig.apply(budget("acme-hourly", "acme", window="hour", amount="1000", currency="USD"))
        wait_until(lambda: ask("acme").status_code == 200, 30, message="acme to be let in")


def test_a_tenant_sending_at_five_times_its_budget_overshoots_it_by_at_most_ten_percent(
    rig: Rig, backends: BackendFactory
) -> None:
    """N tokens a minute, sent at 5N a minute from the window's start: the spend past N within
    the window stays under N/10 (docs/cost.md derives the bound), and a tenant sending beside
    it is never refused."""
    start(rig, backends)
    limit = 3000
    rig.apply(budget("acme-minute", "acme", window="minute", tokens=limit))
    # Start early in a minute so that the whole run fits in one window.
    wait_until(lambda: time.time() % 60 < 30, 40, message="the first half of a minute")
    window = spend(rig, window="minute")["start"]
    body = chat("m-paid", "a prompt of some twenty words " * 3, max_tokens=16)
    timeline: list[tuple[float, float, int, int]] = []
    results = asyncio.run(
        paced(rig.url(), body, limit * 5 / 60, stop_after_refused=1.0, timeline=timeline)
    )
    other = asyncio.run(paced(rig.url(), body, 2.0, tenant="globex", duration=3.0))
    assert all(status == 200 for status, _ in other)
    served = [tokens for status, tokens in results if status == 200]
    assert any(status == 429 for status, _ in results)
    wait_until(
        lambda: (
            sum(
                row["requests"]
                for row in spend(rig, window="minute", by="tenant")["rows"]
                if row["tenant"] == "acme"
            )
            >= len(served)
        ),
        30,
        message="every served request to be counted",
    )
    view = spend(rig, window="minute", by="tenant")
    assert view["start"] == window, "the run crossed a minute boundary"
    counted = sum(row["tokens"] for row in view["rows"] if row["tenant"] == "acme")
    assert counted == sum(served)
    overshoot = counted - limit
    # When the budget was crossed (the answer that took the tenant past it) and when the
    # first request was refused: the decision's lag as a client sees it, to a send interval.
    total, crossed = 0, None
    for _, answered, status, tokens in sorted(timeline, key=lambda t: t[1]):
        total += tokens
        if status == 200 and crossed is None and total >= limit:
            crossed = answered
    refused = min(sent for sent, _, status, _ in timeline if status == 429)
    in_flight = sum(
        tokens for sent, _, status, tokens in timeline if status == 200 and sent > (crossed or 0)
    )
    print(
        f"budget {limit} tokens/min at 5x: spent {counted}, overshoot {overshoot} tokens "
        f"({overshoot / limit:.1%}); first 429 sent {refused - (crossed or refused):.3f}s "
        f"after the crossing answer; {in_flight} tokens admitted after it"
    )
    assert overshoot <= limit // 10


async def paced(
    url: str,
    body: dict[str, Any],
    tokens_per_second: float,
    *,
    tenant: str = "acme",
    stop_after_refused: float | None = None,
    duration: float = 60.0,
    timeline: list[tuple[float, float, int, int]] | None = None,
) -> list[tuple[int, int]]:
    """Requests at a steady token rate (estimated from the first answer's usage), each
    without waiting for the last; until ``duration``, or ``stop_after_refused`` seconds after
    the first 429. Returns (status, tokens) of each; ``timeline`` gets (sent, answered,
    status, tokens) of each, in monotonic seconds."""
    results: list[tuple[int, int]] = []
    async with httpx.AsyncClient(timeout=30) as client:

        async def one() -> tuple[int, int]:
            sent_at = time.monotonic()
            response = await client.post(url, json=body, headers={"x-tenant-id": tenant})
            tokens = 0
            if response.status_code == 200:
                usage = response.json()["usage"]
                tokens = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
            if timeline is not None:
                timeline.append((sent_at, time.monotonic(), response.status_code, tokens))
            return response.status_code, tokens

        first = await one()
        results.append(first)
        interval = max(first[1], 1) / tokens_per_second
        loop = asyncio.get_running_loop()
        started = loop.time()
        refused_at: float | None = None
        pending: list[asyncio.Task[tuple[int, int]]] = []
        sent = 1
        while loop.time() - started < duration:
            pending.append(asyncio.create_task(one()))
            sent += 1
            done = [task for task in pending if task.done()]
            for task in done:
                pending.remove(task)
                results.append(task.result())
                if task.result()[0] == 429 and refused_at is None:
                    refused_at = loop.time()
            if (
                refused_at is not None
                and stop_after_refused is not None
                and loop.time() - refused_at >= stop_after_refused
            ):
                break
            await asyncio.sleep(max(0.0, started + (sent - 1) * interval - loop.time()))
        results.extend(await asyncio.gather(*pending))
    return results


def test_two_replicas_share_spend_and_both_enforce_a_budget(
    etcd_prefix: str,
    kvpilot_factory: KvpilotFactory,
    envoy_factory: Any,
    backends: BackendFactory,
) -> None:
    """Envoys of fleet `a` talk to one kvpilot, those of fleet `b` to another: each replica
    counts its own Envoys' usage, reads the other's from etcd, and both push the block."""
    first = kvpilot_factory(etcd_prefix, extra_args=["--replica-id", "a"])
    second = kvpilot_factory(etcd_prefix, extra_args=["--replica-id", "b"])
    envoys = {
        "a": envoy_factory(xds_port=first.xds_port, fleet="a"),
        "b": envoy_factory(xds_port=second.xds_port, fleet="b"),
    }
    paid = backends(2, id_prefix="paid", model="m-paid", simulator=FAST_SIM)
    ports = {"a": free_port(), "b": free_port()}
    rigs = {
        name: Rig(kvpilot, envoys[name], api_client(kvpilot), ports[name])
        for name, kvpilot in (("a", first), ("b", second))
    }
    with rigs["a"].api, rigs["b"].api:
        rigs["a"].apply(
            pool(
                "paid",
                ports_of(paid),
                models=["m-paid"],
                health_check=FAST_HEALTH_CHECK,
                price=PRICE,
            ),
            *(
                policy(f"web-{name}", port, [route("paid", name="paid")], fleets=[name])
                for name, port in ports.items()
            ),
        )
        for name, rig in rigs.items():
            rig.wait_ready(f"web-{name}/paid", ports_of(paid))
        sent: Counter[str] = Counter()
        with httpx.Client(timeout=30) as client:
            for i in range(12):
                name = "ab"[i % 2]
                response = client.post(
                    rigs[name].url(),
                    json=chat("m-paid", "hello", max_tokens=8),
                    headers={"x-tenant-id": "acme"},
                )
                assert response.status_code == 200, response.text
                sent[name] += 1
        for rig in rigs.values():
            wait_until(
                lambda rig=rig: sum(r["requests"] for r in spend(rig, by="tenant")["rows"]) == 12,
                30,
                message="each replica to see both replicas' spend",
            )
        assert spend(rigs["a"], by="tenant")["rows"] == spend(rigs["b"], by="tenant")["rows"]
        spent = spend(rigs["a"], window="hour", by="tenant")["rows"][0]["tokens"]
        # A budget both replicas already see as spent: both fleets' Envoys refuse acme.
        rigs["b"].apply(budget("acme", "acme", window="hour", tokens=max(1, spent - 1)))
        with httpx.Client(timeout=30) as client:
            for name, rig in rigs.items():
                wait_until(
                    lambda rig=rig: (
                        client.post(
                            rig.url(), json=chat("m-paid", "hello"), headers={"x-tenant-id": "acme"}
                        ).status_code
                        == 429
                    ),
                    30,
                    message=f"fleet {name}'s Envoy to refuse acme",
                )
                other = client.post(
                    rig.url(), json=chat("m-paid", "hello"), headers={"x-tenant-id": "globex"}
                )
                assert other.status_code == 200


def test_a_tenant_past_a_divert_budget_is_served_by_the_cheaper_route(
    rig: Rig, backends: BackendFactory
) -> None:
    start(rig, backends)
    rig.apply(
        budget(
            "acme-paid",
            "acme",
            window="hour",
            tokens=1,
            model="m-paid",
            action="divert",
            divertTo="owned",
        )
    )
    with httpx.Client(timeout=30) as client:

        def served_by(tenant: str) -> str:
            response = client.post(
                rig.url(), json=chat("m-paid", "hello"), headers={"x-tenant-id": tenant}
            )
            assert response.status_code == 200, response.text
            return str(response.json()["backend"])

        wait_until(
            lambda: served_by("acme").startswith("owned"),
            30,
            message="acme's paid-model requests to go to the owned pool",
        )
        assert served_by("globex").startswith("paid")
