"""etcd, `kvpilot serve` and one Envoy together: the whole control path on one machine."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from controlplane.launchers.envoy import EmbeddedEnvoy
from controlplane.launchers.etcd import EmbeddedEtcd
from controlplane.launchers.kvpilot import KvpilotProcess


@dataclass
class LocalStack:
    """An embedded etcd, `kvpilot serve` with an admin token, and one Envoy of the default
    fleet: the whole control path on one machine, for the demo and the benchmarks."""

    etcd: EmbeddedEtcd
    kvpilot: KvpilotProcess
    envoy: EmbeddedEnvoy
    admin_token: str


@contextlib.contextmanager
def local_stack(
    state_dir: Path, *, node_id: str, etcd_args: Sequence[str] = ()
) -> Iterator[LocalStack]:
    """Start etcd, kvpilot and Envoy on free loopback ports under `state_dir` (each waits until
    ready), and stop them in reverse order on exit. The admin token is random per run."""
    token = secrets.token_urlsafe(24)
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(
            EmbeddedEtcd(state_dir / "etcd", extra_args=list(etcd_args)).start()
        )
        kvpilot = stack.enter_context(
            KvpilotProcess(
                state_dir / "kvpilot",
                etcd_endpoints=[etcd.endpoint],
                env={"KVPILOT_ADMIN_TOKEN": token},
            ).start()
        )
        envoy = stack.enter_context(
            EmbeddedEnvoy(
                state_dir / "envoy",
                xds_address="127.0.0.1",
                xds_port=kvpilot.xds_port,
                node_id=node_id,
                fleet="default",
            ).start()
        )
        yield LocalStack(etcd, kvpilot, envoy, token)
