"""kvpilot against an etcd that requires TLS client certificates and user/password auth.

One etcd per module, started with --client-cert-auth and then given users and roles through
the etcd API (what the README's etcdctl commands do) before auth is enabled:

- ``kvpilot``: read-write on the test prefix and its audit log;
- ``agent-gpu``: read-write on pool gpu's telemetry and registrations only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from aetcd import rpc
from harness.rig import BackendFactory
from harness.wait import poll, wait_until

from controlplane.etcd import (
    EtcdAccessDenied,
    EtcdClient,
    EtcdSecurity,
    prefix_range_end,
)
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd, KvpilotProcess, ManagedProcess, repo_root
from controlplane.local.pki import Ca, CertDir
from xdsserver.identity import TlsFiles

pytestmark = pytest.mark.e2e

PREFIX = "/kvpilot-tls"
ROOT_PASSWORD = "root-password-7c1e0b"
KVPILOT_PASSWORD = "kvpilot-password-93af1d"
AGENT_PASSWORD = "agent-password-51d2aa"


@dataclass
class SecureEtcd:
    etcd: EmbeddedEtcd
    ca: Ca
    pki: Path
    kvpilot: EtcdSecurity
    agent: EtcdSecurity


def _grant(auth: Any, role: str, prefix: bytes) -> None:
    auth.RoleGrantPermission(
        rpc.AuthRoleGrantPermissionRequest(
            name=role,
            perm=rpc.Permission(
                permType=rpc.Permission.READWRITE, key=prefix, range_end=prefix_range_end(prefix)
            ),
        )
    )


def _user(auth: Any, name: str, password: str, role: str) -> None:
    auth.UserAdd(rpc.AuthUserAddRequest(name=name, password=password))
    auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=name, role=role))


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    ca = Ca("etcd test CA")
    pki = tmp_path_factory.mktemp("etcd-pki")
    server = CertDir(
        pki / "server",
        ca.issue("etcd-admin", dns=("localhost",), ips=("127.0.0.1",)),
        ca.cert,
    )
    client = CertDir(pki / "kvpilot", ca.issue("kvpilot-client"), ca.cert)
    agent = CertDir(pki / "agent", ca.issue("agent-client"), ca.cert)
    etcd = EmbeddedEtcd(
        tmp_path_factory.mktemp("etcd-tls"),
        tls=TlsFiles(server.cert, server.key, server.ca),
        extra_args=["--unsafe-no-fsync"],
    ).start()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.cert,
        private_key=server.key.read_bytes(),
        certificate_chain=server.cert.read_bytes(),
    )
    with grpc.secure_channel(etcd.endpoint, credentials) as channel:
        # etcdctl user add root; role add ...; role grant-permission --prefix ...; auth enable
        auth = rpc.AuthStub(channel)
        auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
        _user(auth, "root", ROOT_PASSWORD, "root")
        auth.RoleAdd(rpc.AuthRoleAddRequest(name="kvpilot"))
        # One grant covers the prefix and its audit log beside it ({prefix}-audit/).
        _grant(auth, "kvpilot", PREFIX.encode())
        _user(auth, "kvpilot", KVPILOT_PASSWORD, "kvpilot")
        auth.RoleAdd(rpc.AuthRoleAddRequest(name="agent-gpu"))
        _grant(auth, "agent-gpu", f"{PREFIX}/telemetry/gpu/".encode())
        _grant(auth, "agent-gpu", f"{PREFIX}/endpoints/gpu/".encode())
        _user(auth, "agent-gpu", AGENT_PASSWORD, "agent-gpu")
        auth.AuthEnable(rpc.AuthEnableRequest())
    yield SecureEtcd(
        etcd,
        ca,
        pki,
        EtcdSecurity(
            ca=client.ca,
            cert=client.cert,
            key=client.key,
            user="kvpilot",
            password=KVPILOT_PASSWORD,
        ),
        EtcdSecurity(
            ca=agent.ca, cert=agent.cert, key=agent.key, user="agent-gpu", password=AGENT_PASSWORD
        ),
    )
    etcd.stop()


async def test_an_agent_role_writes_its_pools_telemetry_and_not_policy(
    secure_etcd: SecureEtcd, backends: BackendFactory, tmp_path: Path
) -> None:
    replica = backends(1, id_prefix="gpu").replicas[0]
    agent = secure_etcd.agent
    assert agent.ca and agent.cert and agent.key and agent.user and agent.password
    # `kvpilot agent` as it runs in production, with its prefix-scoped etcd user.
    process = ManagedProcess(
        [
            sys.executable,
            "-m",
            "commands.agent",
            "--etcd-endpoints",
            secure_etcd.etcd.endpoint,
            "--etcd-prefix",
            PREFIX,
            *("--etcd-cacert", str(agent.ca), "--etcd-cert", str(agent.cert)),
            *("--etcd-key", str(agent.key), "--etcd-user", agent.user),
            *("--pool", "gpu", "--backend", replica.url, "--register", "--interval", "0.2"),
        ],
        tmp_path / "agent.log",
        env={**os.environ, "KVPILOT_ETCD_PASSWORD": agent.password},
        cwd=repo_root(),
    )
    process.spawn()
    endpoint_id = f"127.0.0.1:{replica.port}"
    try:
        async with EtcdClient([secure_etcd.etcd.endpoint], security=secure_etcd.kvpilot) as client:

            async def written() -> bool:
                telemetry = await client.get(f"{PREFIX}/telemetry/gpu/{endpoint_id}".encode())
                endpoint = await client.get(f"{PREFIX}/endpoints/gpu/{endpoint_id}".encode())
                return telemetry is not None and endpoint is not None

            await poll(written, 30, message="the agent's telemetry and registration in etcd")
    finally:
        process.stop()
    assert AGENT_PASSWORD not in process.log_tail(200)

    # The same credentials cannot touch policy, nor another pool's keys: etcd refuses.
    async with EtcdClient([secure_etcd.etcd.endpoint], security=agent) as client:
        store = Store(client, PREFIX)
        with pytest.raises(EtcdAccessDenied, match="permission"):
            await store.create("Pool", "gpu", {"kind": "Pool"})
        with pytest.raises(EtcdAccessDenied, match="permission"):
            await store.put_telemetry("other", "10.0.0.2:8000", {"queue": 1})
    async with EtcdClient([secure_etcd.etcd.endpoint], security=secure_etcd.kvpilot) as client:
        assert await Store(client, PREFIX).get("Pool", "gpu") is None


async def test_an_expired_auth_token_is_renewed(secure_etcd: SecureEtcd) -> None:
    async with EtcdClient([secure_etcd.etcd.endpoint], security=secure_etcd.kvpilot) as client:
        await client.put(f"{PREFIX}/objects/x/token".encode(), b"{}")
        client._conns[0].token.value = "not-a-token.1"  # what etcd says to an expired one
        assert await client.get(f"{PREFIX}/objects/x/token".encode()) is not None


def _serve_fails(secure_etcd: SecureEtcd, security: EtcdSecurity, tmp_path: Path) -> str:
    process = KvpilotProcess(
        tmp_path,
        etcd_endpoints=[secure_etcd.etcd.endpoint],
        prefix=PREFIX,
        insecure_no_auth=True,
        etcd_security=security,
    )
    env = {"PATH": "/usr/bin:/bin", "KVPILOT_ETCD_PASSWORD": security.password or ""}
    started = time.monotonic()
    result = subprocess.run(
        process._argv(), capture_output=True, text=True, timeout=90, cwd=repo_root(), env=env
    )
    assert result.returncode != 0, result.stderr[-2000:]
    assert time.monotonic() - started < 60
    return result.stderr


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"cert": None, "key": None}, "--etcd-cert"),
        ({"password": "wrong-password-0f9e"}, "password"),
    ],
    ids=["no-client-certificate", "wrong-password"],
)
def test_serve_without_the_right_credentials_stops_at_start_saying_why(
    secure_etcd: SecureEtcd, tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    stderr = _serve_fails(secure_etcd, replace(secure_etcd.kvpilot, **change), tmp_path)
    assert says in stderr, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "wrong-password-0f9e" not in stderr


def _secrets(*values: str) -> list[str]:
    return [v for v in values if v]


def _pem_bodies(*paths: Path) -> list[str]:
    """The base64 lines of PEM private keys: none may leak."""
    lines = []
    for path in paths:
        lines += [line for line in path.read_text().splitlines() if line and "-----" not in line]
    return lines


def test_a_full_run_with_secrets_leaks_none_of_them(
    secure_etcd: SecureEtcd, tmp_path: Path
) -> None:
    """kvpilot with a tokens file, etcd TLS and an etcd password; writes, refusals, a token
    rotation; then its log, status, audit, metrics and every error body hold no secret."""
    admin, reader, later = "admin-secret-5b0c9e77", "read-secret-a3d1f0c2", "later-secret-e8f2b6"
    wrong = "wrong-secret-9c4d2a11"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        "tokens:\n"
        f"  - {{name: deployer, role: admin, token: {admin}}}\n"
        f"  - {{name: dashboards, role: read, token: {reader}}}\n"
    )
    kvpilot = KvpilotProcess(
        tmp_path / "kvpilot",
        etcd_endpoints=[secure_etcd.etcd.endpoint],
        prefix=PREFIX,
        etcd_security=secure_etcd.kvpilot,
        extra_args=["--tokens-file", str(tokens), "--log-level", "debug"],
    ).start()
    bodies: list[str] = []
    try:
        api = httpx.Client(base_url=kvpilot.api_url, timeout=10)

        def call(method: str, path: str, token: str, **kwargs: Any) -> httpx.Response:
            response = api.request(
                method, path, headers={"Authorization": f"Bearer {token}"}, **kwargs
            )
            bodies.append(f"{response.status_code} {dict(response.headers)} {response.text}")
            return response

        pool = {"kind": "Pool", "metadata": {"name": "leak"}, "spec": {}}
        assert call("PUT", "/v1/pools/leak", admin, json=pool).status_code == 201
        assert call("PUT", "/v1/pools/leak", wrong, json=pool).status_code == 401
        assert call("PUT", "/v1/pools/leak", reader, json=pool).status_code == 403
        assert call("PUT", "/v1/pools/leak", admin, json={"kind": 1}).status_code == 422
        assert call("GET", "/v1/pools/nope", admin).status_code == 404

        # Rotate: the read token goes, a new one comes; no restart.
        tokens.write_text(
            "tokens:\n"
            f"  - {{name: deployer, role: admin, token: {admin}}}\n"
            f"  - {{name: newcomer, role: read, token: {later}}}\n"
        )
        rotated = time.monotonic()
        wait_until(
            lambda: call("GET", "/v1/pools", reader).status_code == 401,
            30,
            message="the removed token to stop working",
        )
        print(f"the removed token stopped working {time.monotonic() - rotated:.2f}s after")
        assert call("GET", "/v1/pools", later).status_code == 200

        status = call("GET", "/v1/status", admin).text
        audit = call("GET", "/v1/audit", admin)
        assert audit.json()["items"][0]["actor"] == "deployer"
        metrics = api.get("/metrics").text
        assert re.search(r'kvpilot_api_writes_refused_total\{reason="forbidden"\} 1', metrics)
    finally:
        kvpilot.stop()
    log = kvpilot.log_path.read_text()
    assert "API tokens reloaded" in log and "newcomer" in log  # the names are logged
    haystack = "\n".join([log, status, audit.text, metrics, *bodies])
    security = secure_etcd.kvpilot
    assert security.key is not None
    secrets = _secrets(admin, reader, later, wrong, KVPILOT_PASSWORD, ROOT_PASSWORD)
    secrets += _pem_bodies(security.key)
    leaked = [s for s in secrets if s in haystack]
    assert not leaked, f"secrets found in kvpilot's output: {leaked}"


def test_serve_flags_keep_the_etcd_password_out_of_argv(secure_etcd: SecureEtcd) -> None:
    argv = KvpilotProcess(
        Path("/nonexistent"),
        etcd_endpoints=[secure_etcd.etcd.endpoint],
        etcd_security=secure_etcd.kvpilot,
    )._argv()
    assert KVPILOT_PASSWORD not in " ".join(argv)
    assert "--etcd-user" in argv and "--etcd-cert" in argv
