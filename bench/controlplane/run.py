"""The control-plane benchmark: how fast a change reaches every Envoy, what a big config costs,
and how much memory kvpilot holds.

    python -m bench controlplane [--short] [--out DIR]

It starts an embedded etcd and `kvpilot serve` (as a child process, with one addition: every
ACK it receives is appended with its `time.monotonic()` to a log file, see `bench.controlplane.acklog`).
Then, on the configuration of `bench.controlplane.pools`:

- **real Envoys** (1, 10, 50; `--concurrency 1` each): ~20 times, one registered endpoint's
  weight is changed through the REST API, and the time from just before the PUT until every
  Envoy has ACKed the new EDS version is recorded (p50, p99, and the first Envoy's ACK);
- **simulated streams** (1,000 SotW ADS streams from a separate process, asyncio gRPC, 50
  streams per HTTP/2 connection, each ACKing every response at once): the same changes;
- **10,000 endpoints**: in this process, the reconciler's full rebuild (decode, validate,
  compile, translate, serialize once into a Snapshot), its EDS fast path for one endpoint
  change and its routes path for one route change (LDS and RDS translated, every cluster and
  endpoint reused); then end to end, 10 real Envoys holding that config, the time from an
  endpoint change (EDS) and from a route change (RDS) to every Envoy's ACK; then, with
  nothing written for a minute, the xDS responses kvpilot sends per minute (0: versions are
  content hashes, and a stream sends only what its Envoy does not hold);
- kvpilot's resident memory (`VmRSS` of the daemon) at each stage.

It prints a Markdown table and writes `bench/results/controlplane.json`. `--short` (1 and 3
Envoys, 100 streams, 1,000 endpoints, 8 changes) is the smoke test the suite runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import httpx

from bench.controlplane.acklog import (
    CHANGE_TIMEOUT,
    AckLog,
    AckLogKvpilot,
    Change,
    measure,
    summarize,
)
from bench.controlplane.pools import FLEET, POLICY, pools_and_policy, rebuild_input
from bench.controlplane.results import (
    ClientsRow,
    ControlPlaneConfig,
    ControlPlaneResults,
    IdlePushes,
    Rebuild,
    Scale,
    markdown,
)
from bench.controlplane.scale import TelemetryAtScale
from controlplane.local import (
    EmbeddedEnvoy,
    EmbeddedEtcd,
    ManagedProcess,
    free_port,
    repo_root,
)

CHANGE_POOL = "p0"
CHANGE_ENDPOINT = "moving"
START_TIMEOUT = 120.0
"""Seconds kvpilot may take to answer /readyz: on a loaded machine its imports alone take 30."""


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


# -- the run -------------------------------------------------------------------------------------


class Bench:
    """One etcd, one kvpilot; scenarios add and remove Envoys or simulated streams."""

    def __init__(
        self,
        config: ControlPlaneConfig,
        state_dir: Path,
        kvpilot: Callable[..., AckLogKvpilot] | None = None,
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        self.kvpilot_factory = kvpilot or AckLogKvpilot
        """Makes the kvpilot under test (``bench.controlplane.baseline`` starts an older commit's)."""
        self.etcd = EmbeddedEtcd(state_dir / "etcd", extra_args=["--unsafe-no-fsync"])
        self.kvpilot: AckLogKvpilot | None = None
        self.api: httpx.Client | None = None
        self.acks: AckLog | None = None
        self.weight = 100
        self.pools = 1
        """Pools (and so clusters bench/r0, bench/r1, ...) in the applied configuration."""
        self.results = ControlPlaneResults(Scale.of(config))

    # setup

    def start(self) -> None:
        self.etcd.start()
        self.kvpilot = self.kvpilot_factory(
            self.state_dir / "kvpilot",
            etcd_endpoints=[self.etcd.endpoint],
            prefix="/bench",
            insecure_no_auth=True,
            extra_args=["--log-level", "warning"],
        ).start(START_TIMEOUT)
        self.api = httpx.Client(base_url=self.kvpilot.api_url, timeout=60)
        self.acks = AckLog(self.kvpilot.ack_log)
        self.results.memory_mib["idle"] = rss_mib(self.kvpilot.pid)

    def stop(self) -> None:
        if self.api is not None:
            self.api.close()
        if self.kvpilot is not None:
            self.kvpilot.stop()
        self.etcd.stop()

    def apply(self, endpoints: int, listener_port: int) -> None:
        assert self.api is not None
        objects = pools_and_policy(endpoints, listener_port)
        for path, body in objects:
            self.api.put(path, json=body).raise_for_status()
        self.pools = len(objects) - 1
        self._move_endpoint()

    def served(self, kind: str) -> str:
        assert self.api is not None
        key = {"EDS": "endpoints", "RDS": "routes", "CDS": "clusters", "LDS": "listeners"}[kind]
        deadline = time.monotonic() + CHANGE_TIMEOUT
        while True:
            response = self.api.get(f"/v1/fleets/{FLEET}/config")
            if response.status_code == 200:
                return str(response.json()["versions"][key])
            if time.monotonic() > deadline:
                response.raise_for_status()
            time.sleep(0.05)

    def settled(self, kind: str = "EDS") -> str:
        """The served version of `kind` once the reconciler has quieted down."""
        assert self.api is not None
        previous = ""
        while True:
            # Two reads a debounce window apart that agree: no rebuild is pending.
            version = self.served(kind)
            if version == previous:
                return version
            previous = version
            time.sleep(0.3)

    def _move_endpoint(self) -> None:
        """One change: the weight of a registered endpoint (EDS fast path)."""
        assert self.api is not None
        self.weight = 100 + (self.weight - 99) % 900
        response = self.api.put(
            f"/v1/pools/{CHANGE_POOL}/endpoints/{CHANGE_ENDPOINT}",
            json={"address": "127.0.0.1", "port": 9, "weight": self.weight},
        )
        response.raise_for_status()

    def run_changes(self, nodes: set[str], kind: str = "EDS") -> list[Change]:
        version = self.prepared(nodes, kind)
        changes = []
        for _ in range(self.config.changes):
            change, version = self.change(nodes, kind, version)
            changes.append(change)
        return changes

    def prepared(self, nodes: set[str], kind: str = "EDS", timeout: float = CHANGE_TIMEOUT) -> str:
        """The settled version of `kind`, once every node has ACKed it."""
        assert self.acks is not None
        version = self.settled(kind)
        self.acks.wait_all(nodes, kind, version, timeout)
        return version

    def change(
        self, nodes: set[str], kind: str, version: str, timeout: float = CHANGE_TIMEOUT
    ) -> tuple[Change, str]:
        """One endpoint change (EDS) or route change (RDS) after `version`, timed until every
        node ACKs it; the new version."""
        assert self.acks is not None
        write = self._move_endpoint if kind == "EDS" else self._change_route
        return measure(self.acks, nodes, kind, version, write, timeout)

    def _change_route(self) -> None:
        """One change that is not endpoints only: a route timeout (routes path, RDS)."""
        assert self.api is not None
        body = self.api.get(f"/v1/routingpolicies/{POLICY}").json()
        self.weight += 1
        body["spec"]["routes"][0]["timeouts"] = {"request": f"{self.weight}s"}
        self.api.put(f"/v1/routingpolicies/{POLICY}", json=body).raise_for_status()

    @contextlib.contextmanager
    def envoys(self, count: int, tag: str) -> Iterator[set[str]]:
        assert self.kvpilot is not None
        started: list[EmbeddedEnvoy] = []
        kvpilot = self.kvpilot

        def start(index: int) -> EmbeddedEnvoy:
            envoy = EmbeddedEnvoy(
                self.state_dir / f"envoy-{tag}-{index}",
                xds_address="127.0.0.1",
                xds_port=kvpilot.xds_port,
                node_id=f"envoy-{tag}-{index}",
                fleet=FLEET,
                extra_args=["--concurrency", "1"],
            )
            started.append(envoy)
            return envoy.start(60)

        try:
            # From this thread: launchers set PR_SET_PDEATHSIG, which fires when the thread that
            # spawned a child exits, so a thread pool would kill its Envoys on the way out.
            for index in range(count):
                start(index)
            yield {e.node_id for e in started}
        finally:
            for envoy in started:
                envoy.stop()

    @contextlib.contextmanager
    def streams(self, count: int, listener_port: int) -> Iterator[set[str]]:
        assert self.kvpilot is not None
        nodes = [f"stream-{i}" for i in range(count)]
        process = ManagedProcess(
            [
                sys.executable,
                "-m",
                "bench.controlplane.ads_streams",
                f"127.0.0.1:{self.kvpilot.xds_port}",
                str(count),
                "--eds",
                ",".join(f"{POLICY}/r{p}" for p in range(self.pools)),
                "--rds",
                f"listener-{listener_port}",
            ],
            self.state_dir / "streams.log",
            cwd=repo_root(),
        )
        process.spawn()
        try:
            yield set(nodes)
        finally:
            process.stop()

    # scenarios

    def run(self) -> ControlPlaneResults:
        config, results = self.config, self.results
        assert self.kvpilot is not None
        listener_port = free_port()
        self.apply(3, listener_port)
        for count in config.envoys:
            with self.envoys(count, f"n{count}") as nodes:
                row = ClientsRow.of(
                    f"{count} Envoy", summarize(self.run_changes(nodes)), self._rss()
                )
            results.envoys.append(row)
            print(f"  {count} Envoys: {row.measured()}", flush=True)

        with self.streams(config.streams, listener_port) as nodes:
            row = ClientsRow.of(
                f"{config.streams} simulated streams",
                summarize(self.run_changes(nodes)),
                self._rss(),
            )
        results.envoys.append(row)
        print(f"  {config.streams} streams: {row.measured()}", flush=True)

        results.translation = translation_bench(config.endpoints)
        print(f"  translation: {asdict(results.translation)}", flush=True)

        self.apply(config.endpoints, listener_port)
        results.memory_mib[f"{config.endpoints} endpoints"] = self._rss()
        with self.envoys(config.big_envoys, "big") as nodes:
            eds = summarize(self.run_changes(nodes, "EDS"))
            rds = summarize(self.run_changes(nodes, "RDS"))
            rss = self._rss()
            assert self.kvpilot is not None
            results.idle = idle_pushes(self.kvpilot.api_url, config.idle_seconds)
        print(f"  idle: {asdict(results.idle)}", flush=True)
        label = f"{config.big_envoys} Envoy, {config.endpoints} endpoints"
        results.envoys.append(ClientsRow.of(f"{label}, endpoint change", eds, rss))
        results.envoys.append(ClientsRow.of(f"{label}, route change", rds, rss))
        print(f"  {label}: EDS {asdict(eds)} RDS {asdict(rds)}", flush=True)
        results.telemetry = self.telemetry(listener_port)
        print(f"  telemetry: {asdict(results.telemetry)}", flush=True)
        results.memory_mib["end"] = self._rss()
        return results

    def _rss(self) -> float:
        assert self.kvpilot is not None
        return rss_mib(self.kvpilot.pid)

    def telemetry(self, listener_port: int) -> TelemetryAtScale:
        """Every route telemetry-balanced, every endpoint reporting each second."""
        from bench.controlplane.scale import telemetry_at_scale

        assert self.api is not None and self.kvpilot is not None and self.kvpilot.pid
        objects = pools_and_policy(self.config.endpoints, listener_port, balancing="telemetry")
        path, body = objects[-1]
        self.api.put(path, json=body).raise_for_status()
        endpoints = [
            (pool_body["metadata"]["name"], f"{e['address']}:{e['port']}")
            for _, pool_body in objects[:-1]
            for e in pool_body["spec"]["endpoints"]
        ]
        return asyncio.run(
            telemetry_at_scale(
                self.etcd.endpoint,
                "/bench",
                endpoints,
                self.kvpilot.pid,
                f"{self.kvpilot.api_url}/metrics",
                seconds=self.config.telemetry_seconds,
            )
        )


def xds_responses(api_url: str) -> float:
    """xDS responses kvpilot has sent so far, every type and stream together."""
    text = httpx.get(f"{api_url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvpilot_xds_pushes_total{")
    )


def idle_pushes(api_url: str, seconds: float) -> IdlePushes:
    """xDS responses per minute while nothing changes: every Envoy holds the last snapshot
    (the caller's last change was ACKed by all), and nothing is written for `seconds`.
    Versions are content hashes and streams send only differences, so this is 0."""
    before = xds_responses(api_url)
    time.sleep(seconds)
    sent = xds_responses(api_url) - before
    return IdlePushes(seconds, sent, round(sent * 60 / seconds, 2))


def translation_bench(endpoints: int, repeats: int = 5) -> Rebuild:
    """The reconciler's full rebuild, EDS fast path and routes path over `endpoints` endpoints
    (no I/O; ``bench.controlplane.rebuild_probe``)."""
    from bench.controlplane import rebuild_probe

    measured = rebuild_probe.measure(rebuild_input(endpoints), repeats)
    return Rebuild.from_json({"endpoints": endpoints, **measured})


def run_controlplane(config: ControlPlaneConfig, state_dir: Path | None = None) -> Path:
    """Run every scenario; print the Markdown table; write and return the JSON path."""
    with contextlib.ExitStack() as stack:
        if state_dir is None:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-cp-")))
        bench = Bench(config, state_dir)
        try:
            bench.start()
            results = bench.run()
        finally:
            bench.stop()
    config.out_dir.mkdir(parents=True, exist_ok=True)
    path = config.out_dir / "controlplane.json"
    path.write_text(json.dumps(asdict(results), indent=2) + "\n")
    print(markdown(results))
    return path
