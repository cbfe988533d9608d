"""Bearer-token auth: token sources, and the role matrix on every route of the app."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from harness.api import Harness
from harness.auth import ADMIN, ADMIN_TOKEN, READ, READ_TOKEN
from harness.builders import pool

from api import ApiContext, create_app
from api.auth import AuthConfig, AuthConfigError

PUBLIC = {
    "/healthz",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/ui",
}
"""Routes without a token: health, metrics, the API's docs, and the console's page (static
files; every bit of data it shows comes from the API with the operator's token)."""
WRITE_METHODS = {"POST", "PUT", "DELETE", "PATCH"}
READ_POSTS = {("POST", "/v1/preview")}
"""POSTs that change nothing: a preview takes the objects it previews in its body."""


def test_tokens_come_from_a_file_and_the_environment(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n  - {name: ci, role: admin, token: file-admin-token}\n")
    config = AuthConfig.from_sources(tokens, {"KVPILOT_READ_TOKEN": "env-read-token"})
    assert config.authenticate("file-admin-token").role == "admin"  # type: ignore[union-attr]
    assert config.authenticate("env-read-token").role == "read"  # type: ignore[union-attr]
    assert config.authenticate("nope") is None
    assert config.authenticate(None) is None
    assert config.authenticate("") is None


def test_a_json_tokens_file_works(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text('{"tokens": [{"name": "a", "role": "read", "token": "json-token"}]}')
    principal = AuthConfig.from_sources(tokens, {}).authenticate("json-token")
    assert principal is not None and principal.name == "a"


def test_no_tokens_at_all_is_a_configuration_error() -> None:
    with pytest.raises(AuthConfigError, match="--insecure-no-auth"):
        AuthConfig.from_sources(None, {})


def test_an_invalid_tokens_file_never_echoes_its_secrets(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n  - {name: x, role: root, token: super-secret-value}\n")
    with pytest.raises(AuthConfigError) as info:
        AuthConfig.from_sources(tokens, {})
    assert "role" in str(info.value)
    assert "super-secret-value" not in str(info.value)


def test_duplicate_token_values_are_rejected() -> None:
    with pytest.raises(AuthConfigError, match="same value"):
        AuthConfig([("a", "admin", "same"), ("b", "read", "same")])


def test_repr_does_not_show_tokens() -> None:
    assert ADMIN_TOKEN not in repr(AuthConfig([("ops", "admin", ADMIN_TOKEN)]))


def test_disabled_auth_logs_a_warning_at_start(caplog: pytest.LogCaptureFixture) -> None:
    context = ApiContext(store=None, reconciler=None, connections=None, auth=AuthConfig.disabled())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="api.app"):
        create_app(context)
    assert any("DISABLED" in record.message for record in caplog.records)


# -- the role matrix, over every route the app has ----------------------------------------------


def _routes() -> list[tuple[str, str]]:
    app = create_app(
        ApiContext(store=None, reconciler=None, connections=None, auth=AuthConfig.disabled())
    )  # type: ignore[arg-type]
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path not in PUBLIC:
            found.extend((method, route.path) for method in sorted(route.methods))
    return found


ROUTES = _routes()
WRITES = [r for r in ROUTES if r[0] in WRITE_METHODS and r not in READ_POSTS]
READS = [r for r in ROUTES if r[0] not in WRITE_METHODS or r in READ_POSTS]


def _url(path: str) -> str:
    return re.sub(
        r"\{(\w+)\}", lambda m: "127.0.0.1:8001" if m.group(1) == "endpoint_id" else "chat", path
    )


def test_the_matrix_covers_every_write_route() -> None:
    assert len(WRITES) >= 12  # 3 kinds x (POST, PUT, DELETE) + endpoint PUT, DELETE, weight
    assert all(path.startswith("/v1/") for _, path in ROUTES)


@pytest.mark.e2e
@pytest.mark.parametrize(("method", "path"), WRITES)
async def test_every_write_needs_an_admin_token(api: Harness, method: str, path: str) -> None:
    url = _url(path)
    body: dict[str, Any] = pool("chat")
    if path.endswith("/weight"):
        body = {"weight": 5}
    elif path.endswith("/health"):
        body = {"health": "draining"}
    elif "/endpoints/" in path:
        body = {"address": "127.0.0.1", "port": 8001}
    kwargs = {"json": body} if method != "DELETE" else {}

    no_token = await api.http.request(method, url, headers={"Authorization": ""}, **kwargs)
    assert no_token.status_code == 401
    assert no_token.headers["www-authenticate"] == "Bearer"
    bad_token = await api.http.request(
        method, url, headers={"Authorization": "Bearer wrong"}, **kwargs
    )
    assert bad_token.status_code == 401
    reader = await api.http.request(method, url, headers=READ, **kwargs)
    assert reader.status_code == 403
    assert "admin" in reader.json()["detail"]
    kvs, _ = await api.client.get_prefix(f"{api.prefix}/".encode())
    assert kvs == [], "a refused write reached etcd"

    await api.http.put("/v1/pools/chat", json=pool("chat"), headers=ADMIN)
    admin = await api.http.request(method, url, headers=ADMIN, **kwargs)
    assert admin.status_code not in (401, 403), admin.text
    assert admin.status_code < 500, admin.text


@pytest.mark.e2e
@pytest.mark.parametrize(("method", "path"), READS)
async def test_reads_accept_a_read_token_and_refuse_none(
    api: Harness, method: str, path: str
) -> None:
    await api.http.put("/v1/pools/chat", json=pool("chat"), headers=ADMIN)
    url = _url(path)
    assert (await api.http.request(method, url, headers={"Authorization": ""})).status_code == 401
    reader = await api.http.request(method, url, headers=READ)
    assert reader.status_code not in (401, 403), reader.text
    assert reader.status_code < 500, reader.text


@pytest.mark.e2e
async def test_health_endpoints_need_no_token(api: Harness) -> None:
    async with httpx.AsyncClient(transport=api.http._transport, base_url="http://kvpilot") as anon:
        for path in ("/healthz", "/metrics", "/openapi.json", "/ui/", "/ui/console.js"):
            assert (await anon.get(path)).status_code == 200, path
        assert (await anon.get("/readyz")).status_code in (200, 503)


@pytest.mark.e2e
async def test_tokens_never_appear_in_logs(api: Harness, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        await api.http.put("/v1/pools/chat", json=pool("chat"), headers=ADMIN)
        await api.http.get("/v1/pools/chat", headers=READ)
        await api.http.get("/v1/pools/chat", headers={"Authorization": "Bearer wrong-token"})
    assert ADMIN_TOKEN not in caplog.text
    assert READ_TOKEN not in caplog.text
