"""Development only: local etcd, Envoy and `kvpilot serve` processes for the demo, the
benchmarks and the end-to-end tests, one module for what each launches; `process` holds the
child-process handling they share (process groups, parent-death signal, readiness polling),
and `pki` the throwaway certificate authority of the local stack's mutual TLS.
"""

from controlplane.local.envoy import (
    XDS_TLS_DIR,
    XDS_TLS_SDS_DIR,
    EmbeddedEnvoy,
    render_bootstrap,
)
from controlplane.local.etcd import EmbeddedEtcd, EmbeddedEtcdCluster
from controlplane.local.kvpilot import KvpilotProcess
from controlplane.local.process import (
    Launcher,
    LauncherError,
    ManagedProcess,
    find_binary,
    free_port,
    repo_root,
    wait_until,
)
from controlplane.local.stack import LocalStack, local_stack

__all__ = [
    "XDS_TLS_DIR",
    "XDS_TLS_SDS_DIR",
    "EmbeddedEnvoy",
    "EmbeddedEtcd",
    "EmbeddedEtcdCluster",
    "KvpilotProcess",
    "Launcher",
    "LauncherError",
    "LocalStack",
    "ManagedProcess",
    "find_binary",
    "free_port",
    "local_stack",
    "render_bootstrap",
    "repo_root",
    "wait_until",
]
