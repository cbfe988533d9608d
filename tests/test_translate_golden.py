"""Golden files: each case of ``tests/golden/in/`` (objects, registered endpoints, telemetry
records and a clock) -> the Envoy resources kvpilot generates for every fleet, in
``tests/golden/out/<case>.<fleet>.<kind>.yaml``.

A reviewer reads a diff of Envoy YAML, not of Python asserts. After an intended change,
regenerate with:  KVPILOT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_translate_golden.py
(it rewrites the files, then fails asking for a review of ``git diff tests/golden``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.golden import (
    IN,
    OUT,
    case_names,
    check,
    load_case,
    orphans,
    render_case,
    review_message,
    updating,
)

from compiler import compile_plan
from controlplane.local import find_binary, repo_root
from policies import load_objects
from signals import PolicyState
from xdsserver.static import validate_with_envoy
from xdsserver.translate import translate

EXAMPLES = repo_root() / "policies" / "examples"
CASES = case_names()


@pytest.mark.parametrize("case", CASES)
def test_case_renders_to_its_golden_files(case: str) -> None:
    check(render_case(case, load_case(case)), OUT, update=updating())


def test_no_golden_file_is_left_without_a_case() -> None:
    """A golden file of a case or fleet that is gone pins nothing: it fails (update mode
    deletes it, and fails all the same for the review)."""
    produced: set[str] = set()
    for case in CASES:
        produced |= set(render_case(case, load_case(case)))
    found = orphans(produced, OUT, update=updating())
    assert not found, review_message(found, "no case produces (orphans)")


def test_there_are_twenty_or_more_cases_each_described() -> None:
    assert len(CASES) >= 20, CASES
    for case in CASES:
        text = (IN / f"{case}.yaml").read_text()
        assert text.startswith("description:"), f"{case}.yaml: say first what the case pins"


@pytest.mark.parametrize("example", sorted(p.stem for p in EXAMPLES.glob("*.yaml")))
def test_each_user_example_has_a_case_with_its_objects(example: str) -> None:
    """The user examples are pinned through ``example-<name>`` cases, which must hold the
    example's objects: an edited example needs its case (and golden files) updated."""
    expected = load_objects(EXAMPLES / f"{example}.yaml")
    assert list(load_case(f"example-{example}").objects) == expected


@pytest.mark.parametrize("case", CASES)
def test_case_resources_pass_envoy_validation(case: str, tmp_path: Path) -> None:
    """The golden resources are a config the real Envoy accepts (``envoy --mode validate``)."""
    envoy = find_binary("envoy")
    for fleet in compile_plan(load_case(case).state()).fleets:
        ok, output = validate_with_envoy(translate(fleet), envoy, tmp_path / fleet.fleet)
        assert ok, f"case {case}, fleet {fleet.fleet}: {output}"


def test_all_examples_together_pass_envoy_validation(tmp_path: Path) -> None:
    """Every example applied at once (as `kvpilot apply -f policies/examples/` does) compiles
    without errors, and every fleet's resources pass `envoy --mode validate`."""
    plan = compile_plan(PolicyState.from_objects(load_objects(EXAMPLES)))
    assert not [d for d in plan.diagnostics if d.severity == "error"], plan.diagnostics
    assert {fleet.fleet for fleet in plan.fleets} >= {"default", "edge"}
    envoy = find_binary("envoy")
    for fleet in plan.fleets:
        ok, output = validate_with_envoy(translate(fleet), envoy, tmp_path / fleet.fleet)
        assert ok, f"fleet {fleet.fleet}: {output}"


VERSIONS_SCRIPT = """
import json, sys
from pathlib import Path
from signals import PolicyState
from compiler import compile_plan
from policies import load_objects
from xdsserver.snapshot import Snapshot
from xdsserver.translate import translate
plan = compile_plan(PolicyState.from_objects(load_objects(Path(sys.argv[1]))))
print(json.dumps({
    fleet.fleet: {
        type_url: {name: r.version for name, r in snapshot.resources(type_url).items()}
        for snapshot in [Snapshot.from_messages(translate(fleet).by_type())]
        for type_url in translate(fleet).by_type()
    }
    for fleet in plan.fleets
}))
"""


def test_versions_are_equal_across_processes() -> None:
    """Two kvpilot replicas, or one before and after a restart, hash equal config to equal
    versions, so an Envoy that reconnects elsewhere reloads nothing. Map fields (JSON bodies,
    per-filter configs) inside packed Any fields must serialize in one order for that, whatever
    the process's hash seed."""
    outputs = []
    for seed in ("1", "2", "3"):
        done = subprocess.run(
            [sys.executable, "-c", VERSIONS_SCRIPT, str(EXAMPLES)],
            capture_output=True,
            text=True,
            cwd=repo_root(),
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout))
    assert outputs[0], "no fleet translated"
    assert outputs[0] == outputs[1] == outputs[2]


def test_update_mode_writes_the_files_then_fails_asking_for_a_review(tmp_path: Path) -> None:
    expected = {"case.default.routes.yaml": "- name: new\n"}
    (tmp_path / "case.default.routes.yaml").write_text("- name: old\n")
    with pytest.raises(AssertionError, match=r"Review the change with `git diff tests/golden`"):
        check(expected, tmp_path, update=True)
    assert (tmp_path / "case.default.routes.yaml").read_text() == "- name: new\n"
    # Once reviewed, the same files pass, with or without the flag.
    check(expected, tmp_path, update=False)
    check(expected, tmp_path, update=True)
    (tmp_path / "case.default.routes.yaml").write_text("- name: edited by hand\n")
    with pytest.raises(AssertionError, match="regenerate with KVPILOT_UPDATE_GOLDEN=1"):
        check(expected, tmp_path, update=False)
    assert (tmp_path / "case.default.routes.yaml").read_text() == "- name: edited by hand\n"


def test_orphans_are_reported_and_deleted_only_in_update_mode(tmp_path: Path) -> None:
    for name in ("case.default.routes.yaml", "case.gone-fleet.routes.yaml"):
        (tmp_path / name).write_text("[]\n")
    produced = {"case.default.routes.yaml"}
    assert orphans(produced, tmp_path) == ["case.gone-fleet.routes.yaml"]
    assert (tmp_path / "case.gone-fleet.routes.yaml").exists()
    assert orphans(produced, tmp_path, update=True) == ["case.gone-fleet.routes.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case.default.routes.yaml"]
    assert orphans(produced, tmp_path) == []
