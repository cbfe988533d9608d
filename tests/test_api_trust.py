"""The REST API's trust features: an audit entry for every write route, writes refused for auth
counted, per-token write rate limits, CORS closed unless configured, tokens reloaded from their
file without a restart."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.api import Harness, running_api
from harness.auth import ADMIN_TOKEN, READ, auth_config
from harness.builders import fleet, policy, pool, rollout
from harness.spend import budget
from harness.wait import poll

from api.auth import AuthConfig, TokenReloader, WriteRateLimit
from controlplane.audit import AuditLog, diff
from controlplane.etcd.store import Actor, Store
from controlplane.local import EmbeddedEtcd
from controlplane.rollouts.state import state_key

WRITE_METHODS = {"post", "put", "delete", "patch"}


async def newest_audit(api: Harness) -> dict[str, Any]:
    response = await api.http.get("/v1/audit", params={"limit": 1}, headers=READ)
    assert response.status_code == 200, response.text
    [entry] = response.json()["items"]
    return entry


def _rollout(**spec: Any) -> dict[str, Any]:
    return rollout("r", target=("m", "all"), stable="a", canary="b", **spec)


def _endpoint(weight: int = 1) -> dict[str, Any]:
    return {"address": "127.0.0.1", "port": 9001, "weight": weight}


# Each write route (by OpenAPI operation id), exercised once with a valid request; the audit
# entry it leaves must name the route, the token, and carry a diff.
WRITES: dict[str, Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]] = {
    "create_pools": lambda h: h.post("/v1/pools", json=pool("a")),
    "replace_pools": lambda h: h.put("/v1/pools/a", json=pool("a", [8003])),
    "create_routingpolicies": lambda h: h.post(
        "/v1/routingpolicies", json=policy("m", pools=("a",))
    ),
    "replace_routingpolicies": lambda h: h.put(
        "/v1/routingpolicies/m", json=policy("m", 10001, pools=("a",))
    ),
    "register_endpoint": lambda h: h.put("/v1/pools/a/endpoints/e1", json=_endpoint()),
    "set_endpoint_weight": lambda h: h.put("/v1/pools/a/endpoints/e1/weight", json={"weight": 7}),
    "deregister_endpoint": lambda h: h.delete("/v1/pools/a/endpoints/e1"),
    "create_fleets": lambda h: h.post("/v1/fleets", json=fleet("f")),
    "replace_fleets": lambda h: h.put("/v1/fleets/f", json=fleet("f", maxRequestBodyBytes=1024)),
    "delete_fleets": lambda h: h.delete("/v1/fleets/f"),
    "create_budgets": lambda h: h.post(
        "/v1/budgets", json=budget("bg", "acme", window="day", tokens=1000)
    ),
    "replace_budgets": lambda h: h.put(
        "/v1/budgets/bg", json=budget("bg", "acme", window="hour", amount="5", currency="USD")
    ),
    "delete_budgets": lambda h: h.delete("/v1/budgets/bg"),
    "set_endpoint_health": lambda h: h.put(
        "/v1/pools/a/endpoints/127.0.0.1:8003/health", json={"health": "draining"}
    ),
    "create_rollouts": lambda h: h.post("/v1/rollouts", json=_rollout()),
    "replace_rollouts": lambda h: h.put(
        "/v1/rollouts/r",
        json=_rollout(steps=[{"weight": 20, "minDuration": "30s"}, {"weight": 100}]),
    ),
    "rollout_command": lambda h: h.post("/v1/rollouts/r/pause"),
    "delete_rollouts": lambda h: h.delete("/v1/rollouts/r"),
    "delete_routingpolicies": lambda h: h.delete("/v1/routingpolicies/m"),
    "delete_pools": lambda h: h.delete("/v1/pools/a"),
}
READ_ONLY_POSTS = {"preview"}
"""POST routes that write nothing (a dry run), so they leave no audit entry."""


async def test_every_write_route_leaves_an_audit_entry_with_token_and_diff(api: Harness) -> None:
    schema = (await api.http.get("/openapi.json")).json()
    write_routes = {
        operation["operationId"]
        for item in schema["paths"].values()
        for method, operation in item.items()
        if method in WRITE_METHODS
    } - READ_ONLY_POSTS
    assert write_routes == set(WRITES), "a write route is missing from WRITES (or gone)"
    # A second pool for the rollout's canary, and the driving replica's record that the
    # rollout started (no controller runs here), so a command can be given.
    assert (await api.http.post("/v1/pools", json=pool("b", [8005]))).is_success
    previous_revision = 0
    for operation, call in WRITES.items():
        if operation == "rollout_command":
            stored = await api.store.get("Rollout", "r")
            assert stored is not None
            await api.store.put_record(
                state_key("r"),
                {"phase": "Progressing", "object": stored.created_revision, "step": 0},
                kind="Rollout",
                name="r",
            )
        response = await call(api.http)
        assert response.is_success, (operation, response.text)
        entry = await newest_audit(api)
        assert entry["operation"] == operation
        assert entry["actor"] == "ops"
        assert entry["diff"], (operation, entry)
        assert entry["revisionAfter"] > previous_revision
        previous_revision = entry["revisionAfter"]
        assert ADMIN_TOKEN not in str(entry)

    entries = (await api.http.get("/v1/audit", headers=READ)).json()["items"]
    by_operation = {e["operation"]: e for e in entries}
    weight = by_operation["set_endpoint_weight"]
    assert weight["object"] == {"kind": "Endpoint", "name": "e1", "pool": "a"}
    assert weight["diff"] == [{"op": "replace", "path": "/weight", "value": 7, "old": 1}]
    assert weight["revisionBefore"] == by_operation["register_endpoint"]["revisionAfter"]
    replaced = by_operation["replace_pools"]
    assert replaced["action"] == "replace"
    [endpoints] = [op for op in replaced["diff"] if op["path"] == "/spec/endpoints"]
    assert endpoints["op"] == "replace"
    assert [e["port"] for e in endpoints["old"]] == [8001, 8002]
    assert [e["port"] for e in endpoints["value"]] == [8003]
    deleted = by_operation["delete_pools"]
    assert deleted["action"] == "delete" and deleted["diff"][0]["op"] == "remove"


async def test_writes_refused_for_auth_leave_no_audit_entry_and_are_counted(
    api: Harness,
) -> None:
    nobody = {"Authorization": "Bearer not-a-token"}
    assert (await api.http.post("/v1/pools", json=pool("x"), headers=nobody)).status_code == 401
    assert (await api.http.post("/v1/pools", json=pool("x"), headers=READ)).status_code == 403
    assert (await api.http.get("/v1/pools", headers=nobody)).status_code == 401  # not a write
    metrics = (await api.http.get("/metrics")).text
    assert 'kvpilot_api_writes_refused_total{reason="unauthenticated"} 1.0' in metrics
    assert 'kvpilot_api_writes_refused_total{reason="forbidden"} 1.0' in metrics
    assert (await api.http.get("/v1/audit", headers=READ)).json()["items"] == []


async def test_each_token_has_its_own_write_rate_limit(
    etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    auth = AuthConfig([("ops", "admin", ADMIN_TOKEN), ("ci", "admin", "ci-token-0123456789")])
    limit = WriteRateLimit(rate=0.01, burst=2)
    async with running_api(etcd.endpoint, etcd_prefix, auth=auth, write_limit=limit) as api:
        for name in ("a", "b"):
            assert (await api.http.put(f"/v1/pools/{name}", json=pool(name))).is_success
        over = await api.http.put("/v1/pools/c", json=pool("c"))
        assert over.status_code == 429
        assert int(over.headers["retry-after"]) >= 1
        assert "'ops'" in over.json()["detail"] and "write rate limit" in over.json()["detail"]
        assert await api.store.get("Pool", "c") is None
        # Reads are not limited, and another token has its own bucket.
        assert (await api.http.get("/v1/pools")).status_code == 200
        other = {"Authorization": "Bearer ci-token-0123456789"}
        assert (await api.http.put("/v1/pools/c", json=pool("c"), headers=other)).is_success
        metrics = (await api.http.get("/metrics")).text
        assert 'kvpilot_api_writes_refused_total{reason="rate_limited"} 1.0' in metrics


def test_the_write_bucket_refills_at_its_rate() -> None:
    now = [0.0]
    limit = WriteRateLimit(rate=2.0, burst=1, clock=lambda: now[0])
    assert limit.acquire("t") == 0
    assert limit.acquire("t") == pytest.approx(0.5)
    now[0] += 0.5
    assert limit.acquire("t") == 0


@pytest.mark.parametrize("configured", [False, True], ids=["closed", "configured"])
async def test_cors_is_closed_unless_an_origin_is_configured(
    etcd: EmbeddedEtcd, etcd_prefix: str, configured: bool
) -> None:
    origins = ("https://console.example.com",) if configured else ()
    async with running_api(etcd.endpoint, etcd_prefix, cors_origins=origins) as api:
        preflight = {
            "Origin": "https://console.example.com",
            "Access-Control-Request-Method": "PUT",
            "Access-Control-Request-Headers": "authorization,content-type",
        }
        response = await api.http.options("/v1/pools/a", headers=preflight)
        allowed = response.headers.get("access-control-allow-origin")
        assert allowed == ("https://console.example.com" if configured else None)
        stranger = await api.http.options(
            "/v1/pools/a", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert stranger.headers.get("access-control-allow-origin") is None


async def test_a_reloaded_tokens_file_revokes_and_adds_tokens_without_a_restart(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n  - {name: old, role: admin, token: old-token-value}\n")
    config = AuthConfig.from_sources(tokens, {})
    reloader = TokenReloader(config, tokens, {}, interval=0.1)
    watcher = asyncio.create_task(reloader.watch())
    try:
        assert config.authenticate("old-token-value") is not None
        tokens.write_text("tokens:\n  - {name: new, role: read, token: new-token-value}\n")
        started = time.monotonic()
        await poll(
            lambda: config.authenticate("old-token-value") is None,
            30,
            "the removed token to stop working",
        )
        print(f"the removed token stopped working {time.monotonic() - started:.2f}s after")
        principal = config.authenticate("new-token-value")
        assert principal is not None and principal.name == "new"
        # A broken file keeps the tokens in force rather than locking everyone out.
        tokens.write_text("tokens: [{name: x, role: nope, token: broken-token-value}]\n")
        assert reloader.reload() is False
        assert config.authenticate("new-token-value") is not None
        # An empty list is valid: it revokes the last token.
        tokens.write_text("tokens: []\n")
        assert reloader.reload() is True
        assert config.authenticate("new-token-value") is None
    finally:
        watcher.cancel()


async def test_the_audit_log_keeps_only_its_retention(etcd: EmbeddedEtcd, etcd_prefix: str) -> None:
    async with running_api(etcd.endpoint, etcd_prefix) as api:
        audit = AuditLog(api.client, etcd_prefix, retention=3)
        store = Store(api.client, etcd_prefix, on_write=audit.record)
        for port in range(8000, 8006):
            await store.replace(
                "Pool", "p", pool("p", [port]), expect_revision=None, actor=Actor("t")
            )
        entries = await audit.entries(limit=100)
        assert len(entries) == 3
        assert [e["revisionAfter"] for e in entries] == sorted(
            (e["revisionAfter"] for e in entries), reverse=True
        )
        assert entries[-1]["revisionBefore"] is not None


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ({"a": 1}, {"a": 2}, [{"op": "replace", "path": "/a", "value": 2, "old": 1}]),
        ({"a": 1}, {}, [{"op": "remove", "path": "/a", "old": 1}]),
        (None, {"a": 1}, [{"op": "add", "path": "", "value": {"a": 1}}]),
        ({"l": [1, 2]}, {"l": [1, 3]}, [{"op": "replace", "path": "/l/1", "value": 3, "old": 2}]),
        ({"l": [1]}, {"l": [1, 2]}, [{"op": "replace", "path": "/l", "value": [1, 2], "old": [1]}]),
        ({"a/b": 1}, {"a/b": 1}, []),
    ],
)
def test_diff_is_json_patch_with_old_values(before: Any, after: Any, expected: Any) -> None:
    assert diff(before, after) == expected


def test_auth_config_repr_and_names_never_hold_token_values() -> None:
    config = auth_config()
    assert ADMIN_TOKEN not in repr(config) and ADMIN_TOKEN not in str(config.names)
    assert re.fullmatch(r"AuthConfig\(enabled=True, tokens=\[.*\]\)", repr(config))
