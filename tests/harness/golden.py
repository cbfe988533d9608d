"""Golden files in Envoy Gateway's shape: ``tests/golden/in/<case>.yaml`` (objects, registered
endpoints, telemetry records and a clock) -> ``tests/golden/out/<case>.<fleet>.<kind>.yaml``
(clusters, endpoints, listeners, routes), rendered by ``xdsserver.render``, the renderer
``kvpilot translate`` and the REST dry run use. And ``tests/golden/bench/``: benchmark runs'
files (real ``--short`` runs) and the Markdown reports rendered from them (`check` with
``out=BENCH``).

``KVPILOT_UPDATE_GOLDEN=1`` rewrites the files (and deletes the ones no case produces any
more), then fails anyway: a regenerated golden file is a change to review, not a pass.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from policies import decode_documents
from xdsserver.render import RESOURCE_KEYS, RenderInput, parse_render_input, render_input

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
IN = GOLDEN / "in"
OUT = GOLDEN / "out"
BENCH = GOLDEN / "bench"
UPDATE_FLAG = "KVPILOT_UPDATE_GOLDEN"


def updating() -> bool:
    """True when the golden files are to be regenerated."""
    return os.environ.get(UPDATE_FLAG) == "1"


def case_names(directory: Path = IN) -> list[str]:
    """Every case, by file name without ``.yaml``."""
    return sorted(path.stem for path in directory.glob("*.yaml"))


def case_document(case: str, directory: Path = IN) -> dict[str, Any]:
    """A case's input document as decoded YAML (for tests that change one field of it)."""
    path = directory / f"{case}.yaml"
    (document,) = decode_documents(path.read_bytes(), source=str(path))
    assert isinstance(document, dict), f"{path}: a case is one mapping"
    return document


def load_case(case: str, directory: Path = IN) -> RenderInput:
    """A case's input, validated."""
    return parse_render_input(case_document(case, directory), source=f"{case}.yaml")


def to_yaml(resources: list[dict[str, Any]]) -> str:
    """One resource list as a golden file: keys sorted, so map fields inside packed Anys read
    the same whatever order a process serialized them in."""
    return yaml.safe_dump(resources, sort_keys=True, width=100)


def golden_files(case: str, rendered: Mapping[str, Any]) -> dict[str, str]:
    """File name -> text for a case's ``render_input`` result: one file per fleet and kind."""
    return {
        f"{case}.{fleet}.{kind}.yaml": to_yaml(resources[kind])
        for fleet, resources in rendered["fleets"].items()
        for kind in RESOURCE_KEYS
    }


def render_case(case: str, given: RenderInput) -> dict[str, str]:
    """A case's golden files; a case whose objects compile with errors is a broken case."""
    rendered = render_input(given)
    errors = [d for d in rendered["diagnostics"] if d["severity"] == "error"]
    assert not errors, f"case {case}: compile errors {errors}"
    assert rendered["fleets"], f"case {case}: no fleet gets any configuration"
    return golden_files(case, rendered)


def compare(expected: Mapping[str, str], out: Path = OUT, *, update: bool = False) -> list[str]:
    """The files of ``expected`` whose text differs from (or is missing in) ``out``; with
    ``update`` those files are written first. Empty: everything matches."""
    differing = []
    for name, text in sorted(expected.items()):
        path = out / name
        if path.exists() and path.read_text() == text:
            continue
        differing.append(name)
        if update:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return differing


def orphans(produced: set[str], out: Path = OUT, *, update: bool = False) -> list[str]:
    """Golden files in ``out`` that no case produces any more (a fleet or case that is
    gone); with ``update`` they are deleted."""
    found = sorted(path.name for path in out.glob("*.yaml") if path.name not in produced)
    if update:
        for name in found:
            (out / name).unlink()
    return found


def check(expected: Mapping[str, str], out: Path = OUT, *, update: bool = False) -> None:
    """Fail unless every file of ``expected`` is in ``out`` as it is. With ``update`` the
    differing files are written, and the check still fails when any differed: the new files
    are a change a person must review before the test may pass."""
    differing = compare(expected, out, update=update)
    assert not differing, review_message(differing, "written" if update else "differ", update)


def review_message(names: list[str], what: str, update: bool | None = None) -> str:
    """Why a golden test failed, and what to do about it."""
    update = updating() if update is None else update
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    if update:
        return (
            f"{UPDATE_FLAG}=1 {what}: {shown}. Review the change with `git diff tests/golden` "
            f"and commit it; then run again without {UPDATE_FLAG} to pass"
        )
    return (
        f"golden files {what}: {shown}. If the change is intended, regenerate with "
        f"{UPDATE_FLAG}=1 and review `git diff tests/golden`"
    )


def set_field(document: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set one field of a decoded document in place; the field's parent must exist."""
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
