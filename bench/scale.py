"""The control-plane benchmark's scale section: today's code against a baseline, side by side.

    python -m bench controlplane --baseline REF [--only scale]

Machines (and a loaded machine from one minute to the next) differ severalfold, so a speed-up
is only meaningful against the old code measured in the same run. The baseline is `REF` (a
commit, branch or tag of this repository) checked out into a temporary detached git worktree;
each round runs `translation_bench` once from the baseline tree and once from this tree, in
fresh child processes (so neither warms the other's caches), alternating which goes first. The
report gives each side's median over the rounds and their ratio.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from controlplane.launchers import repo_root

MEASURES = ("full_rebuild_ms", "fast_path_ms", "routes_path_ms")
"""What `translation_bench` reports, in process: a full rebuild, one endpoint changed (EDS
fast path), one route timeout changed (routes path)."""


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


def _translation_in(tree: Path, endpoints: int) -> dict[str, Any]:
    """`translation_bench(endpoints)` of the code in `tree`, in a child process."""
    code = (
        "import json, sys; sys.path.insert(0, '.'); "
        "from bench.controlplane import translation_bench; "
        f"print(json.dumps(translation_bench({endpoints})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, check=True, capture_output=True, text=True
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def translation_side_by_side(ref: str, endpoints: int, rounds: int = 3) -> dict[str, Any]:
    """Medians of the baseline's and this tree's in-process rebuild times, and old/new."""
    samples: dict[str, dict[str, list[float]]] = {
        side: {m: [] for m in MEASURES} for side in ("baseline", "new")
    }
    with baseline_tree(ref) as tree:
        sides = {"baseline": tree, "new": repo_root()}
        for index in range(rounds):
            order = ["baseline", "new"] if index % 2 == 0 else ["new", "baseline"]
            for side in order:
                result = _translation_in(sides[side], endpoints)
                for measure in MEASURES:
                    samples[side][measure].append(result[measure])
                print(f"  round {index + 1} {side}: {result}", flush=True)
    rows = {}
    for measure in MEASURES:
        old = statistics.median(samples["baseline"][measure])
        new = statistics.median(samples["new"][measure])
        rows[measure] = {"baseline": old, "new": new, "speedup": round(old / new, 1)}
    return {"baseline": ref, "endpoints": endpoints, "rounds": rounds, "rebuild": rows}


def markdown(results: dict[str, Any]) -> str:
    labels = {
        "full_rebuild_ms": "full rebuild",
        "fast_path_ms": "one endpoint changed (EDS fast path)",
        "routes_path_ms": "one route timeout changed (routes path)",
    }
    lines = [
        f"In process at {results['endpoints']} endpoints, baseline `{results['baseline']}` and "
        f"this tree alternately, median of {results['rounds']} rounds:",
        "",
        "| rebuild | baseline ms | new ms | speed-up |",
        "|---|---:|---:|---:|",
    ]
    for measure, row in results["rebuild"].items():
        lines.append(
            f"| {labels[measure]} | {row['baseline']} | {row['new']} | {row['speedup']}x |"
        )
    return "\n".join([*lines, ""])
