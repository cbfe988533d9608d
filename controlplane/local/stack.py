"""etcd, `kvpilot serve` and one Envoy together: the whole control path on one machine."""

from __future__ import annotations

import contextlib
import secrets
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from controlplane.local.envoy import EmbeddedEnvoy
from controlplane.local.etcd import EmbeddedEtcd
from controlplane.local.kvpilot import KvpilotProcess
from xdsserver.identity import TlsFiles

LOCAL_FLEET_IDENTITY = "spiffe://kvpilot.local/fleet/default"
"""The SPIFFE ID of the local stack's Envoy certificate, bound to the default fleet."""


@dataclass
class LocalStack:
    """An embedded etcd, `kvpilot serve` with an admin token, and one Envoy of the default
    fleet: the whole control path on one machine, for the demo and the benchmarks.

    ADS is mutual TLS, as in production, with a CA made for this run: the Envoy's certificate
    carries `LOCAL_FLEET_IDENTITY`, which kvpilot binds to the default fleet."""

    etcd: EmbeddedEtcd
    kvpilot: KvpilotProcess
    envoy: EmbeddedEnvoy
    admin_token: str


@contextlib.contextmanager
def local_stack(
    state_dir: Path,
    *,
    node_id: str,
    etcd_args: Sequence[str] = (),
    kvpilot_args: Sequence[str] = (),
) -> Iterator[LocalStack]:
    """Start etcd, kvpilot (with `kvpilot_args` added to ``kvpilot serve``) and Envoy on free
    loopback ports under `state_dir` (each waits until ready), and stop them in reverse order
    on exit. The admin token and the ADS CA are new
    for each run (the CA needs the `cryptography` package of the `local` extra)."""
    from controlplane.local.pki import Ca, CertDir

    token = secrets.token_urlsafe(24)
    ca = Ca("kvpilot local CA")
    pki = state_dir / "pki"
    shutil.rmtree(pki, ignore_errors=True)
    server = CertDir(
        pki / "kvpilot", ca.issue("kvpilot", dns=("kvpilot",), ips=("127.0.0.1",)), ca.cert
    )
    client = CertDir(pki / "envoy", ca.issue(node_id, uris=(LOCAL_FLEET_IDENTITY,)), ca.cert)
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(
            EmbeddedEtcd(state_dir / "etcd", extra_args=list(etcd_args)).start()
        )
        kvpilot = stack.enter_context(
            KvpilotProcess(
                state_dir / "kvpilot",
                etcd_endpoints=[etcd.endpoint],
                env={"KVPILOT_ADMIN_TOKEN": token},
                xds_tls=TlsFiles(server.cert, server.key, server.ca),
                xds_identity_fleets=[f"{LOCAL_FLEET_IDENTITY}=default"],
                extra_args=list(kvpilot_args),
            ).start()
        )
        envoy = stack.enter_context(
            EmbeddedEnvoy(
                state_dir / "envoy",
                xds_address="127.0.0.1",
                xds_port=kvpilot.xds_port,
                node_id=node_id,
                fleet="default",
                xds_tls_dir=client.path,
            ).start()
        )
        yield LocalStack(etcd, kvpilot, envoy, token)
