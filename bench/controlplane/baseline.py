"""Today's code against a baseline commit, side by side in one run.

    python -m bench controlplane --baseline REF [--only scale]

Machines (and a loaded machine from one minute to the next) differ severalfold, so a speed-up
is only meaningful against the old code measured in the same run. The baseline is `REF` (a
commit, branch or tag of this repository) checked out into a temporary detached git worktree.

- **Rebuilds in process**: each round runs ``bench/rebuild_probe.py`` (this tree's copy, so
  both sides are timed by the same lines on the same input) once against the baseline tree's
  code and once against this tree's, in fresh child processes (so neither warms the other's
  caches), alternating which goes first. Reported: each side's median over the rounds and
  their ratio, on the wall clock and in CPU time.
- **One endpoint change to real Envoys** (``ack_side_by_side``): two etcds, the baseline's
  ``kvpilot serve`` started from its worktree (its own cwd and PYTHONPATH, with the flags every
  version knows) and this tree's, each holding the same 10,000 endpoints and serving its own
  10 Envoys; changes alternate between the two, so both meet the same machine. Reported: the
  time from the REST write until every Envoy ACKed, p50 and p99 per side, and their ratio.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.controlplane.acklog import AckLogKvpilot, AckTimes, Change, summarize
from bench.controlplane.pools import rebuild_input
from bench.controlplane.rebuild_probe import MEASURES
from bench.controlplane.results import ControlPlaneConfig
from bench.controlplane.run import Bench
from bench.rig.report import table
from controlplane.local import free_port, repo_root

PROBE = Path(__file__).with_name("rebuild_probe.py")
SETTLE_TIMEOUT = 600.0
"""Seconds for every Envoy to ACK the 10,000-endpoint config, or one change: the baseline
takes seconds per rebuild and per push, many more on a loaded machine."""


@contextlib.contextmanager
def baseline_tree(ref: str) -> Iterator[Path]:
    """`ref` checked out in a temporary detached worktree, removed afterwards."""
    root = repo_root()
    with tempfile.TemporaryDirectory(prefix="kvp-baseline-") as parent:
        tree = Path(parent) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(tree), ref],
            cwd=root,
            check=True,
        )
        try:
            yield tree
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)], cwd=root, check=False
            )


def _probe_in(tree: Path, state_file: Path, repeats: int) -> dict[str, Any]:
    """``rebuild_probe.measure`` of this tree's probe against the code in `tree`, in a child
    process whose imports resolve in `tree` (its cwd, first on sys.path)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "KVPILOT_PROBE_INPUT": str(state_file),
        "KVPILOT_PROBE_REPEATS": str(repeats),
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE.read_text()],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@dataclass(frozen=True)
class SideBySide:
    """One measure, the baseline's and this tree's medians, and old/new."""

    baseline: float
    new: float
    speedup: float


@dataclass(frozen=True)
class RebuildComparison:
    """`translation_side_by_side`'s numbers (the JSON file is their `asdict`)."""

    baseline: str
    """The baseline's git ref."""
    endpoints: int
    rounds: int
    rebuild: dict[str, SideBySide]
    """By the probe's key (``full_rebuild_ms``, ``full_rebuild_cpu_ms``, ...)."""


@dataclass(frozen=True)
class AckComparison:
    """`ack_side_by_side`'s numbers (the JSON file is their `asdict`)."""

    baseline: str
    endpoints: int
    envoys: int
    sides: dict[str, AckTimes]
    """``baseline`` and ``new``."""
    p50_speedup: float
    p99_speedup: float


def translation_side_by_side(
    ref: str, endpoints: int, rounds: int = 3, repeats: int = 5
) -> RebuildComparison:
    """Medians of the baseline's and this tree's in-process rebuild times, and old/new."""
    keys = [f"{m}_ms" for m in MEASURES] + [f"{m}_cpu_ms" for m in MEASURES]
    samples: dict[str, dict[str, list[float]]] = {
        side: {k: [] for k in keys} for side in ("baseline", "new")
    }
    with baseline_tree(ref) as tree, tempfile.TemporaryDirectory(prefix="kvp-probe-") as tmp:
        state_file = Path(tmp) / "state.json"
        state_file.write_text(json.dumps(rebuild_input(endpoints)))
        sides = {"baseline": tree, "new": repo_root()}
        for index in range(rounds):
            order = ["baseline", "new"] if index % 2 == 0 else ["new", "baseline"]
            for side in order:
                result = _probe_in(sides[side], state_file, repeats)
                for key in keys:
                    samples[side][key].append(result[key])
                print(f"  round {index + 1} {side}: {result}", flush=True)
    rows = {}
    for key in keys:
        old = statistics.median(samples["baseline"][key])
        new = statistics.median(samples["new"][key])
        rows[key] = SideBySide(old, new, round(old / new, 1))
    return RebuildComparison(ref, endpoints, rounds, rows)


def markdown(results: RebuildComparison) -> str:
    labels = {
        "first_full_rebuild": "first full rebuild of the process (nothing cached)",
        "full_rebuild": "full rebuild",
        "fast_path": "one endpoint changed (EDS fast path)",
        "routes_path": "one route timeout changed (routes path)",
    }
    rows = results.rebuild
    lines = [
        f"In process at {results.endpoints} endpoints, baseline `{results.baseline}` and "
        f"this tree alternately, median of {results.rounds} rounds (each the median of "
        "several rebuilds), wall clock and CPU time of the process:",
        "",
    ]
    lines += table(
        (
            "rebuild", "baseline ms", "new ms", "speed-up", "baseline CPU ms", "new CPU ms",
            "speed-up",
        ),
        (
            (
                label, wall.baseline, wall.new, f"{wall.speedup}x", cpu.baseline,
                cpu.new, f"{cpu.speedup}x",
            )
            for measure, label in labels.items()
            for wall, cpu in [(rows[f"{measure}_ms"], rows[f"{measure}_cpu_ms"])]
        ),
        "lrrrrrr",
    )  # fmt: skip
    return "\n".join([*lines, ""])


# -- one endpoint change to real Envoys ---------------------------------------------------------


class BaselineKvpilot(AckLogKvpilot):
    """The baseline's `kvpilot serve` with its ACK log, started from the baseline worktree.

    Run as ``python -m bench.controlplane serve`` from that tree (its cwd and PYTHONPATH), so
    it is the baseline's daemon and the baseline's ACK log hook; only the flags every version
    of ``serve`` knows are given (plaintext ADS and no auth were its defaults)."""

    def __init__(self, tree: Path, state_dir: Path, **kwargs: Any) -> None:
        super().__init__(state_dir, cwd=tree, env={"PYTHONPATH": str(tree)}, **kwargs)

    def _argv(self) -> list[str]:
        # Plaintext ADS was the baseline's default, before the flag that now asks for it.
        return [arg for arg in super()._argv() if arg != "--xds-insecure-plaintext"]


def ack_side_by_side(
    ref: str, endpoints: int = 10_000, envoys: int = 10, changes: int = 20
) -> AckComparison:
    """One endpoint change to `envoys` real Envoys holding `endpoints` endpoints, the baseline
    `ref` and this tree alternately: p50/p99 of the time to every Envoy's ACK, and old/new."""
    config = ControlPlaneConfig(endpoints=endpoints, big_envoys=envoys, changes=changes)
    samples: dict[str, list[Change]] = {"baseline": [], "new": []}
    with baseline_tree(ref) as tree, tempfile.TemporaryDirectory(prefix="kvp-acks-") as tmp:
        benches = {
            "baseline": Bench(
                config, Path(tmp) / "baseline", functools.partial(BaselineKvpilot, tree)
            ),
            "new": Bench(config, Path(tmp) / "new"),
        }
        with contextlib.ExitStack() as stack:
            nodes: dict[str, set[str]] = {}
            versions: dict[str, str] = {}
            for side, bench in benches.items():
                stack.callback(bench.stop)
                bench.start()
                # The Envoys connect to a small config, then take the large one: started
                # against 10,000 endpoints on a loaded machine, an Envoy can outwait its start.
                port = free_port()
                bench.apply(3, port)
                nodes[side] = stack.enter_context(bench.envoys(envoys, side))
                bench.apply(endpoints, port)
            for side, bench in benches.items():
                versions[side] = bench.prepared(nodes[side], timeout=SETTLE_TIMEOUT)
            for index in range(changes):
                order = ["baseline", "new"] if index % 2 == 0 else ["new", "baseline"]
                for side in order:
                    change, versions[side] = benches[side].change(
                        nodes[side], "EDS", versions[side], SETTLE_TIMEOUT
                    )
                    samples[side].append(change)
                print(
                    f"  change {index + 1}: "
                    + ", ".join(f"{s} {samples[s][-1].all_acked * 1000:.0f} ms" for s in order),
                    flush=True,
                )
    rows = {side: summarize(changes) for side, changes in samples.items()}
    return AckComparison(
        baseline=ref,
        endpoints=endpoints,
        envoys=envoys,
        sides=rows,
        p50_speedup=round(rows["baseline"].p50_ms / rows["new"].p50_ms, 1),
        p99_speedup=round(rows["baseline"].p99_ms / rows["new"].p99_ms, 1),
    )


def acks_markdown(results: AckComparison) -> str:
    sides = results.sides
    lines = [
        f"One endpoint change at {results.endpoints} endpoints to {results.envoys} real "
        f"Envoys, baseline `{results.baseline}` and this tree alternately "
        f"({sides['new'].changes} changes each): time from the REST write until every Envoy "
        "ACKed.",
        "",
    ]
    lines += table(
        ("side", "p50 ms", "p99 ms", "p99/p50", "first ACK p50 ms"),
        (
            (
                side,
                row.p50_ms,
                row.p99_ms,
                round(row.p99_ms / row.p50_ms, 1),
                row.first_ack_p50_ms,
            )
            for side, row in sides.items()
        ),
        "lrrrr",
    )
    lines += [
        "",
        f"Speed-up: p50 {results.p50_speedup}x, p99 {results.p99_speedup}x.",
        "",
    ]
    return "\n".join(lines)
