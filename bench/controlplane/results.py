"""The control-plane benchmark's configuration, its typed results and their Markdown report
(the run itself is `bench.controlplane.run`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.controlplane.acklog import AckTimes
from bench.rig.jsonfields import known
from bench.rig.report import table
from controlplane.local import repo_root

if TYPE_CHECKING:
    from bench.controlplane.scale import TelemetryAtScale

RESULTS_DIR = repo_root() / "bench" / "results"


@dataclass(frozen=True)
class ControlPlaneConfig:
    envoys: tuple[int, ...] = (1, 10, 50)
    streams: int = 1000
    endpoints: int = 10_000
    big_envoys: int = 10
    changes: int = 20
    idle_seconds: float = 60.0
    """How long the 10,000-endpoint stack is watched idle for xDS responses."""
    telemetry_seconds: float = 30.0
    out_dir: Path = RESULTS_DIR


def default_config(*, short: bool = False) -> ControlPlaneConfig:
    if short:
        return ControlPlaneConfig(
            envoys=(1, 3),
            streams=100,
            endpoints=1000,
            big_envoys=3,
            changes=8,
            idle_seconds=5.0,
            telemetry_seconds=4.0,
        )
    return ControlPlaneConfig()


@dataclass(frozen=True)
class Scale:
    """How big the run was (the JSON file's ``config``)."""

    envoys: list[int]
    streams: int
    endpoints: int
    big_envoys: int
    changes: int

    @classmethod
    def of(cls, config: ControlPlaneConfig) -> Scale:
        return cls(
            list(config.envoys),
            config.streams,
            config.endpoints,
            config.big_envoys,
            config.changes,
        )


@dataclass(frozen=True)
class ClientsRow:
    """One row of the change-to-ACK table: which clients, their ACK times, kvpilot's RSS."""

    clients: str
    changes: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    first_ack_p50_ms: float
    rss_mib: float

    @classmethod
    def of(cls, clients: str, times: AckTimes, rss_mib: float) -> ClientsRow:
        return cls(clients, **asdict(times), rss_mib=rss_mib)

    def measured(self) -> dict[str, Any]:
        """The row without its label, as the progress lines print it."""
        return {k: v for k, v in asdict(self).items() if k != "clients"}


@dataclass(frozen=True)
class IdlePushes:
    """xDS responses kvpilot sent while nothing changed."""

    seconds: float
    responses: float
    per_minute: float


@dataclass(frozen=True, kw_only=True)
class Rebuild:
    """The reconciler's rebuilds in process (`bench.controlplane.rebuild_probe`, whose
    output, a JSON object, these fields name): median wall and CPU milliseconds of each."""

    endpoints: int
    clusters: int
    serialized_kib: int
    first_full_rebuild_ms: float
    """The process's first full rebuild: nothing cached yet, as at start."""
    first_full_rebuild_cpu_ms: float
    full_rebuild_ms: float
    full_rebuild_cpu_ms: float
    fast_path_ms: float
    """One endpoint changed (EDS)."""
    fast_path_cpu_ms: float
    routes_path_ms: float
    """One route timeout changed (LDS, RDS)."""
    routes_path_cpu_ms: float

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Rebuild:
        """The probe's object, with the endpoints it was given."""
        return cls(**known(cls, data))


@dataclass
class ControlPlaneResults:
    """Everything the control-plane benchmark measured; the JSON file is its `asdict`."""

    config: Scale
    envoys: list[ClientsRow] = field(default_factory=list)
    memory_mib: dict[str, float] = field(default_factory=dict)
    """kvpilot's RSS at named points of the run."""
    translation: Rebuild | None = None
    """`rebuild_probe.measure`'s numbers."""
    telemetry: TelemetryAtScale | None = None
    """`bench.controlplane.scale.telemetry_at_scale`'s numbers."""
    idle: IdlePushes | None = None
    """xDS responses while the big stack sat idle (0 expected)."""


def markdown(results: ControlPlaneResults) -> str:
    lines = [
        "## kvpilot control plane",
        "",
        "Time from a write through the REST API to every client ACKing the new version "
        f"({results.config.changes} changes each).",
        "",
    ]
    lines += table(
        ("clients", "p50 ms", "p99 ms", "max ms", "first ACK p50 ms", "kvpilot RSS MiB"),
        (
            (row.clients, row.p50_ms, row.p99_ms, row.max_ms, row.first_ack_p50_ms, row.rss_mib)
            for row in results.envoys
        ),
        "lrrrrr",
    )
    t = results.translation
    if t is not None:
        lines += [
            "",
            f"Rebuild at {t.endpoints} endpoints ({t.clusters} clusters, "
            f"{t.serialized_kib} KiB serialized), in process:",
            "",
        ]
        lines += table(
            ("rebuild", "ms"),
            (
                (
                    "full: decode, validate, compile, translate, serialize (Snapshot)",
                    t.full_rebuild_ms,
                ),
                ("the same, the process's first (nothing cached yet)", t.first_full_rebuild_ms),
                ("EDS fast path: one endpoint changed", t.fast_path_ms),
                ("routes path: one route timeout changed (LDS, RDS)", t.routes_path_ms),
            ),
            "lr",
        )
    lines += [
        "",
        "kvpilot RSS MiB: " + ", ".join(f"{k} {v}" for k, v in results.memory_mib.items()),
        "",
    ]
    if results.idle is not None:
        idle = results.idle
        lines += [
            f"Idle at {results.config.endpoints} endpoints, {results.config.big_envoys} Envoys: "
            f"{idle.per_minute} xDS pushes per minute ({idle.responses:g} responses in "
            f"{idle.seconds:g} s with nothing changed).",
            "",
        ]
    if results.telemetry is not None:
        from bench.controlplane.scale import telemetry_markdown

        lines.append(telemetry_markdown(results.telemetry))
    return "\n".join(lines)
