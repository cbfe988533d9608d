"""kvpilot with an ACK log, and the time from a write to every node's ACK read from it.

`AckLogKvpilot` starts ``kvpilot serve`` through ``python -m bench.controlplane serve``
(`serve_with_ack_log`): the daemon as it is, plus one line per ACK it receives, with its
`time.monotonic()`. CLOCK_MONOTONIC is shared by all processes on Linux, so a benchmark reads
exact ACK times without polling kvpilot (`AckLog`, `measure`). The entry stays in
``bench.controlplane``, which every commit has: ``bench.controlplane.baseline`` starts an older commit's
daemon through that commit's own copy of it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from controlplane.local import KvpilotProcess

CHANGE_TIMEOUT = 60.0
"""Seconds one change may take to reach every Envoy before the run fails."""


class AckLogKvpilot(KvpilotProcess):
    """`kvpilot serve` started through this module's `serve` entry, which logs every ACK."""

    def __init__(self, state_dir: Path, **kwargs: Any) -> None:
        super().__init__(state_dir, **kwargs)
        self.ack_log = self.state_dir / "acks.log"

    def _argv(self) -> list[str]:
        argv = super()._argv()
        argv[argv.index("commands.cli")] = "bench.controlplane"
        return [*argv, "--ack-log", str(self.ack_log)]


def serve_with_ack_log(argv: list[str]) -> int:
    """Child process: `kvpilot serve`, plus one line per ACK: monotonic time, node, type,
    version. Line-buffered so the benchmark sees each ACK as it happens."""
    import commands.serve as serve_module
    from xdsserver.resources import short_name
    from xdsserver.status import ConnectionRegistry, ConnectionStatus

    parser = argparse.ArgumentParser(prog="python -m bench.controlplane serve")
    serve_module.add_arguments(parser)
    parser.add_argument("--ack-log", type=Path, required=True)
    args = parser.parse_args(argv)
    out: TextIO = args.ack_log.open("a", buffering=1)

    class AckLogRegistry(ConnectionRegistry):
        def acked(self, status: ConnectionStatus, type_url: str, *, version: str) -> None:
            super().acked(status, type_url, version=version)
            out.write(f"{time.monotonic():.6f} {status.node_id} {short_name(type_url)} {version}\n")

    return serve_module.run(args, connection_registry=AckLogRegistry)


@dataclass
class AckLog:
    """Reads the ACK log as it grows: the latest EDS/RDS/... version each node ACKed."""

    path: Path
    offset: int = 0
    latest: dict[tuple[str, str], str] = field(default_factory=dict)

    def read(self) -> list[tuple[float, str, str, str]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        acks = []
        for line in data[:end].decode().splitlines():
            at, node, kind, version = line.split(" ")
            self.latest[(node, kind)] = version
            acks.append((float(at), node, kind, version))
        return acks

    def wait_all(self, nodes: set[str], kind: str, version: str, timeout: float) -> None:
        """Until every node has ACKed `version` of `kind`."""
        deadline = time.monotonic() + timeout
        while True:
            self.read()
            missing = [n for n in nodes if self.latest.get((n, kind)) != version]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(missing)} of {len(nodes)} never ACKed {kind} {version}")
            time.sleep(0.05)


@dataclass
class Change:
    all_acked: float
    """Seconds from just before the write until the last node ACKed."""
    first_acked: float


def measure(
    acks: AckLog,
    nodes: set[str],
    kind: str,
    previous: str,
    write: Callable[[], None],
    timeout: float = CHANGE_TIMEOUT,
) -> tuple[Change, str]:
    """Run `write` and time it until every node ACKs a `kind` version other than `previous`."""
    acks.read()
    started = time.monotonic()
    write()
    first: dict[str, float] = {}
    version = ""
    deadline = started + timeout
    while len(first) < len(nodes):
        for at, node, ack_kind, ack_version in acks.read():
            if ack_kind == kind and ack_version != previous and node in nodes:
                first.setdefault(node, at)
                version = ack_version
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(first)} of {len(nodes)} nodes ACKed the change")
        time.sleep(0.001)
    return Change(max(first.values()) - started, min(first.values()) - started), version


@dataclass(frozen=True)
class AckTimes:
    """The time from a write until the clients ACKed it, over several changes."""

    changes: int
    p50_ms: float
    """Until every client ACKed, median."""
    p99_ms: float
    max_ms: float
    first_ack_p50_ms: float
    """Until the first client ACKed, median."""


def summarize(changes: list[Change]) -> AckTimes:
    alls = sorted(c.all_acked for c in changes)
    firsts = sorted(c.first_acked for c in changes)
    return AckTimes(
        changes=len(changes),
        p50_ms=round(statistics.median(alls) * 1000, 1),
        p99_ms=round(_percentile(alls, 0.99) * 1000, 1),
        max_ms=round(alls[-1] * 1000, 1),
        first_ack_p50_ms=round(statistics.median(firsts) * 1000, 1),
    )


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile (with 20 samples, p99 is the largest)."""
    rank = max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 1)) - 1))
    return ordered[rank]
