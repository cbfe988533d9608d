"""Token accounting end to end: simulated vLLM replicas -> a real Envoy whose Lua filter reads
each response's usage -> the access log service of a real `kvpilot serve` -> etcd -> the
REST view, Prometheus, the CLI, a restarted replica that continues from what it stored, and a
paid provider reached by DNS name whose client leaves after the last event."""

from __future__ import annotations

import json
import threading
from collections import Counter
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from harness.auth import READ_TOKEN
from harness.builders import chat, policy, pool, route
from harness.rig import BackendFactory, KvpilotFactory, Rig
from harness.spend import (
    PRICE,
    by,
    pool_rows,
    spend,
    start,
    wait_counted,
)
from harness.wait import wait_until

from commands.cli import main as cli_main

pytestmark = pytest.mark.e2e


def events(text: str) -> list[Any]:
    """The JSON events of an SSE body (``[DONE]`` left out)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def send_mixed(rig: Rig, rounds: int) -> tuple[Counter[str], list[dict[str, Any]]]:
    """Requests of three tenants to two models: JSON, streams that ask for usage and streams
    that do not (no stream_options, include_usage false, empty or null stream_options); the same
    prompts come back (prefix cache hits). Returns requests per tenant
    and the usage blocks the clients saw."""
    sent: Counter[str] = Counter()
    seen: list[dict[str, Any]] = []
    with httpx.Client(timeout=30) as client:
        for i in range(rounds):
            for tenant in ("acme", "globex", "initech"):
                for model in ("m-paid", "m-owned"):
                    content = f"{tenant} asks about item {i % 3} " + "with context " * (5 + i % 4)
                    headers = {"x-tenant-id": tenant}
                    kind = i % 6
                    body = chat(model, content, max_tokens=4 + i % 5)
                    if kind == 1:
                        body |= {"stream": True, "stream_options": {"include_usage": True}}
                    elif kind == 2:
                        body |= {"stream": True}
                    elif kind == 3:
                        body |= {"stream": True, "stream_options": {"include_usage": False}}
                    elif kind == 4:
                        body = {"stream_options": {}, **body, "stream": True}
                    elif kind == 5:
                        body |= {"stream": True, "stream_options": None}
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
    # A window or a grouping that does not parse is a 422 that names it.
    for params, name in (({"window": "week"}, "window"), ({"by": "tenant,colour"}, "by")):
        response = rig.api.get("/v1/spend", params=params)
        assert response.status_code == 422 and name in response.json()["detail"], response.text
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


class StreamingProvider:
    """An OpenAI-ish provider reached by DNS name (``localhost``), so Envoy logs its resolved
    address and not the pool's: it answers a stream with one text event, the usage event and
    ``[DONE]``, then holds the response open until ``release`` is set, as a server that ends
    its stream a moment after the last event does."""

    USAGE = {
        "prompt_tokens": 1200,
        "completion_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 200},
    }

    def __init__(self) -> None:
        self.release = threading.Event()
        provider = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
                if not body.get("stream"):
                    answer = {
                        "object": "chat.completion",
                        "model": "m-api",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "hi"}}
                        ],
                        "usage": provider.USAGE,
                    }
                    payload = json.dumps(answer).encode()
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                delta = {"index": 0, "delta": {"content": "hi"}}
                for event in (
                    {"object": "chat.completion.chunk", "model": "m-api", "choices": [delta]},
                    {"object": "chat.completion.chunk", "model": "m-api", "choices": [],
                     "usage": provider.USAGE},
                ):  # fmt: skip
                    self._chunk(f"data: {json.dumps(event)}\n\n".encode())
                self._chunk(b"data: [DONE]\n\n")
                provider.release.wait(30)
                self._chunk(b"")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port: int = self.server.server_address[1]


def test_a_providers_usage_is_priced_even_when_the_client_leaves_after_the_last_event(
    rig: Rig,
) -> None:
    """Two things a paid API meets that simulated replicas on 127.0.0.1 do not: Envoy logs
    the address a DNS name resolved to, which names no pool (the pool comes from the host's
    metadata instead), and clients (the OpenAI SDK among them) stop reading at ``[DONE]``
    and may close the connection before the stream's end reached Envoy."""
    provider = StreamingProvider()
    threading.Thread(target=provider.server.serve_forever, daemon=True).start()
    try:
        rig.apply(
            pool(
                "api",
                [],
                models=["m-api"],
                endpoints=[{"address": "localhost", "port": provider.port}],
                healthCheck={"enabled": False},
                price=PRICE,
            ),
            policy("web", rig.listener_port, [route("api", name="api")]),
        )
        with httpx.Client(timeout=30) as client:
            wait_until(
                lambda: client.post(rig.url(), json=chat("m-api", "hello")).status_code == 200,
                30,
                message="the provider through Envoy",
            )
        # The client reads to [DONE] and closes its connection; the provider has not ended
        # the stream yet.
        with httpx.Client(timeout=30) as client:
            body = chat("m-api", "hello") | {
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with client.stream("POST", rig.url(), json=body) as response:
                assert response.status_code == 200
                seen = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        seen.append(json.loads(line[6:]) if line != "data: [DONE]" else None)
                    if seen and seen[-1] is None:
                        break  # [DONE]: leaving the block closes the connection mid-stream
                assert seen[-2]["usage"] == StreamingProvider.USAGE
        assert not provider.release.is_set()  # the provider had not ended the stream
        rows = wait_until(
            lambda: (rows := pool_rows(rig)).get("api", {}).get("requests", 0) >= 2 and rows,
            30,
            message="both responses counted for the provider's pool",
        )
        assert "" not in rows, rows  # nothing the accounting could not place
        api = spend(rig, by="pool")["rows"]
        (row,) = [r for r in api if r["pool"] == "api"]
        # Every response of the warm-up and the stream: 1,000 uncached and 200 cached prompt
        # tokens and 30 completion tokens at the pool's price.
        each = (1000 * Decimal("2.50") + 200 * Decimal("1.25") + 30 * Decimal("10")) / 1_000_000
        assert row["currency"] == "USD"
        assert Decimal(row["cost"]) == each * row["requests"]
        assert row["completionTokens"] == 30 * row["requests"]
    finally:
        provider.release.set()
        provider.server.shutdown()
        provider.server.server_close()
