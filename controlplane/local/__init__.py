"""Development only: local etcd, Envoy and `kvpilot serve` processes for the demo, the
benchmarks and the end-to-end tests, one module for what each launches. `launcher` holds the
lifecycle they share (context manager, ports picked again when taken, readiness over HTTP),
`process` the child-process handling beneath it (binaries, process groups, parent-death
signal), and `pki` the throwaway certificate authority of the local stack's mutual TLS.
"""

from controlplane.local.envoy import (
    XDS_TLS_DIR,
    XDS_TLS_SDS_DIR,
    EmbeddedEnvoy,
    render_bootstrap,
)
from controlplane.local.etcd import EmbeddedEtcd, EmbeddedEtcdCluster
from controlplane.local.kvpilot import KvpilotProcess
from controlplane.local.launcher import Launcher
from controlplane.local.process import (
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
