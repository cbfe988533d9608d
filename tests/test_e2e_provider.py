"""An external provider over TLS as the last failover tier, through a real Envoy.

The provider is a local HTTPS server with a self-signed certificate for `localhost`; Envoy
resolves it by DNS, verifies its certificate against the pool's CA file, sends SNI and the
rewritten Host, and adds the credential header from a secret file on the Envoy host.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import subprocess
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.builders import fleet, policy, pool
from harness.jsonserver import json_server
from harness.rig import BackendFactory, Rig
from harness.status import envoy_types
from harness.wait import wait_until

pytestmark = pytest.mark.e2e

SECRET = "Bearer sk-provider-test-key"


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) and key for DNS name `name`."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


class Provider:
    """A tiny OpenAI-ish HTTPS server that records what each request carried."""

    def __init__(self, certfile: Path, keyfile: Path) -> None:
        self.seen: list[dict[str, str]] = []
        self.sni: list[str | None] = []
        self.port = 0
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(certfile, keyfile)
        self.tls.sni_callback = lambda sock, name, ctx: self.sni.append(name)  # type: ignore[assignment]

    def answer(self, request: BaseHTTPRequestHandler) -> tuple[Any, dict[str, str]]:
        request.rfile.read(int(request.headers.get("content-length", "0")))
        self.seen.append(
            {
                "authorization": request.headers.get("authorization", ""),
                "host": request.headers.get("host", ""),
            }
        )
        body = {"object": "chat.completion", "backend": "provider"}
        return body, {"x-backend-id": "provider"}


@contextlib.contextmanager
def running_provider(directory: Path, name: str) -> Iterator[tuple[Provider, Path]]:
    """A provider at `localhost` whose self-signed certificate names `name`; with its CA file."""
    cert, key = self_signed(directory, name)
    server = Provider(cert, key)
    with json_server(server.answer, tls=server.tls) as server.port:
        yield server, cert


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[tuple[Provider, Path]]:
    with running_provider(tmp_path, "localhost") as running:
        yield running


@pytest.fixture
def impostor(tmp_path: Path) -> Iterator[tuple[Provider, Path]]:
    """A provider at `localhost` whose certificate, trusted as its own CA, names another host."""
    with running_provider(tmp_path, "other.provider.test") as running:
        yield running


def provider_setup(
    secrets: Path, local_port: int, provider_port: int, cert: Path, listener_port: int
) -> list[dict[str, Any]]:
    """A local replica tier, then the TLS provider with its credential from `secrets`."""
    return [
        fleet("default", secretsDir=str(secrets)),
        pool("local", [local_port]),
        pool(
            "provider",
            [],
            endpoints=[{"address": "localhost", "port": provider_port}],
            tls={"sni": "localhost", "caFile": str(cert)},
            hostRewrite="api.provider.test",
            auth={"secretRef": {"name": "provider-key"}},
            healthCheck={"enabled": False},
        ),
        policy("failover", listener_port, [{"name": "chat", "tiers": [["local"], ["provider"]]}]),
    ]


def write_secret(secrets: Path) -> None:
    """The provider's credential in Envoy's SDS file format, as an operator deploys it."""
    secret = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
        "name": "provider-key",
        "generic_secret": {"secret": {"inline_string": SECRET}},
    }
    (secrets / "provider-key.yaml").write_text(json.dumps({"resources": [secret]}))


def test_provider_tier_gets_tls_sni_host_rewrite_and_the_secret_header(
    tmp_path: Path,
    provider: tuple[Provider, Path],
    rig: Rig,
    backends: BackendFactory,
) -> None:
    server, cert = provider
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    write_secret(secrets)
    replicas = backends(1, id_prefix="local")
    rig.apply(
        *provider_setup(secrets, replicas.replicas[0].port, server.port, cert, rig.listener_port)
    )
    url = rig.url()
    client = httpx.Client(timeout=10)

    def ask() -> httpx.Response:
        return client.post(
            url,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer client-key-must-not-leak"},
        )

    wait_until(lambda: ask().headers.get("x-backend-id") == "local-0", 30, message="the local tier")
    # While the route's clusters warm up a request may reach the provider tier; once the
    # local tier answers, the provider sees nothing while it stays healthy.
    server.seen.clear()
    assert [ask().headers.get("x-backend-id") for _ in range(5)] == ["local-0"] * 5
    assert server.seen == []

    # The replicas fail: retries move to the provider tier and no request fails.
    replicas.fail("local-0", 503)
    answers = [ask() for _ in range(10)]
    assert [a.status_code for a in answers] == [200] * 10
    assert {a.headers["x-backend-id"] for a in answers} == {"provider"}
    assert server.seen and all(seen["authorization"] == SECRET for seen in server.seen)
    assert {seen["host"] for seen in server.seen} == {"api.provider.test"}
    assert set(server.sni) == {"localhost"}

    # Recovery: the local tier takes traffic again.
    replicas.fail("local-0", 0)
    wait_until(
        lambda: ask().headers.get("x-backend-id") == "local-0", 60, message="the local tier back"
    )


def test_a_missing_secret_file_shows_as_a_nack_and_the_local_tier_keeps_serving(
    tmp_path: Path,
    provider: tuple[Provider, Path],
    rig: Rig,
    backends: BackendFactory,
) -> None:
    """kvpilot cannot see the Envoy hosts' files. When the secret file is missing, Envoy
    rejects only the provider's credential listener: it NACKs the update (status shows which
    file), and still applies the other listeners of it (Envoy's LDS handling), so the local
    tier serves and only the provider tier is out."""
    server, cert = provider
    secrets = tmp_path / "secrets"
    secrets.mkdir()  # but no provider-key.yaml in it
    replicas = backends(1, id_prefix="local")
    envoy = rig.envoy
    rig.apply(
        *provider_setup(secrets, replicas.replicas[0].port, server.port, cert, rig.listener_port)
    )

    def lds_nack() -> dict[str, Any] | None:
        nack: dict[str, Any] | None = (
            envoy_types(rig.api, envoy.node_id).get("LDS", {}).get("last_nack")
        )
        return nack or None

    nack = wait_until(lds_nack, 30, message="the LDS NACK to show in /v1/status")
    assert "provider/internal" in nack["message"], nack  # the listener it rejected ...
    assert "provider-key.yaml" in nack["message"], nack  # ... and why

    url = rig.url()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def local_answers() -> bool:
        return httpx.post(url, json=body, timeout=10).headers.get("x-backend-id") == "local-0"

    wait_until(local_answers, 30, message="the policy's listener to serve despite the NACK")
    # With the local tier down, the provider tier has no listener to go through.
    replicas.fail("local-0", 503)
    failed = httpx.post(url, json=body, timeout=10)
    assert failed.status_code == 503 and server.seen == [], failed.text

    # The file appears. kvpilot does not resend a version Envoy rejected, so Envoy creates the
    # listener with the next listener change for the fleet (or when it restarts).
    write_secret(secrets)
    rig.apply(fleet("default", secretsDir=str(secrets), accessLog=False))

    def provider_answers() -> bool:
        return httpx.post(url, json=body, timeout=10).headers.get("x-backend-id") == "provider"

    wait_until(provider_answers, 30, message="the provider tier once the file exists")
    assert server.seen and all(seen["authorization"] == SECRET for seen in server.seen)


def test_a_provider_certificate_for_another_name_is_refused(
    tmp_path: Path,
    impostor: tuple[Provider, Path],
    rig: Rig,
    backends: BackendFactory,
) -> None:
    """The certificate chains to the pool's CA file but names another host than the SNI:
    Envoy must refuse the connection, so no request (nor the credential) reaches it."""
    server, cert = impostor
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    write_secret(secrets)
    replicas = backends(1, id_prefix="local")
    envoy = rig.envoy
    rig.apply(
        *provider_setup(secrets, replicas.replicas[0].port, server.port, cert, rig.listener_port)
    )
    url = rig.url()
    client = httpx.Client(timeout=30)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    wait_until(
        lambda: client.post(url, json=body).headers.get("x-backend-id") == "local-0",
        60,
        message="the local tier",
    )

    answers: list[httpx.Response] = []

    def refused_by_name() -> int:
        # A request each attempt: until the provider's name resolves, a request meets no
        # host at all (503 without a handshake) and a mismatch is never counted.
        answers.append(client.post(url, json=body))
        return sum(
            int(value)
            for name, value in envoy.stats().items()
            if name.endswith(".ssl.fail_verify_san")
        )

    replicas.fail("local-0", 503)  # every request now goes on to the provider tier
    wait_until(refused_by_name, 30, message="Envoy to count a certificate name mismatch")
    assert {a.status_code for a in answers} == {503}, [a.text for a in answers]
    assert "provider" not in {a.headers.get("x-backend-id") for a in answers}
    assert server.seen == []
