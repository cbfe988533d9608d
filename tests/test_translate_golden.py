"""Golden files: each example policy -> the Envoy resources kvpilot generates for every fleet.

A reviewer reads a diff of Envoy YAML, not of Python asserts. After an intended change,
regenerate with:  KVPILOT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_translate_golden.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format

from compiler import compile_plan
from controlplane.local import find_binary, repo_root
from policies import load_objects
from signals import PolicyState
from xdsserver.static import validate_with_envoy
from xdsserver.translate import translate

EXAMPLES = repo_root() / "policies" / "examples"
GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("KVPILOT_UPDATE_GOLDEN") == "1"


def state_of(path: Path) -> PolicyState:
    return PolicyState.from_objects(load_objects(path))


def render(messages: tuple[object, ...]) -> str:
    # Through JSON so that nested OrderedDicts (from Any fields) become plain data.
    docs = [
        json.loads(json_format.MessageToJson(m, preserving_proto_field_name=True, sort_keys=True))
        for m in messages
    ]
    return yaml.safe_dump(docs, sort_keys=False, width=100)


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=[p.stem for p in EXAMPLE_FILES])
def test_example_translates_to_golden_resources(example: Path) -> None:
    plan = compile_plan(state_of(example))
    assert not [d for d in plan.diagnostics if d.severity == "error"], plan.diagnostics
    mismatches = []
    for fleet in plan.fleets:
        resources = translate(fleet)
        for kind, messages in (
            ("clusters", resources.clusters),
            ("endpoints", resources.endpoints),
            ("listeners", resources.listeners),
            ("routes", resources.routes),
        ):
            path = GOLDEN / example.stem / f"{fleet.fleet}.{kind}.yaml"
            text = render(messages)
            if UPDATE:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            elif not path.exists() or path.read_text() != text:
                mismatches.append(str(path.relative_to(GOLDEN)))
    assert not mismatches, (
        f"generated resources differ from golden files {mismatches}; if intended, rerun with "
        "KVPILOT_UPDATE_GOLDEN=1 and review the diff"
    )


def test_all_examples_together_pass_envoy_validation(tmp_path: Path) -> None:
    """Every example applied at once (as `kvpilot apply -f policies/examples/` does) compiles
    without errors, and every fleet's resources pass `envoy --mode validate`."""
    plan = compile_plan(state_of(EXAMPLES))
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


def test_versions_are_equal_across_processes(tmp_path: Path) -> None:
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
