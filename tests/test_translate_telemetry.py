"""`kvpilot translate --telemetry FILE`: what live signals do to the Envoy resources, offline,
through the renderer the golden files come from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.golden import case_document, load_case

from commands.cli import main
from policies import PolicyError
from xdsserver.render import parse_render_input, render_input


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def split_case(case: str, directory: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A golden case as a user has it: a policy file and a telemetry file."""
    document = case_document(case)
    objects = directory / "objects.yaml"
    objects.write_text(yaml.safe_dump_all(document["objects"]))
    telemetry = directory / "telemetry.json"
    telemetry.write_text(json.dumps(document["telemetry"]))
    return objects, telemetry, document


def eds_weights(fleets: dict[str, Any]) -> dict[str, int]:
    (assignment,) = fleets["default"]["endpoints"]
    return {
        lb["endpoint"]["address"]["socketAddress"]["address"]: lb["loadBalancingWeight"]
        for locality in assignment["endpoints"]
        for lb in locality["lbEndpoints"]
    }


def test_telemetry_file_gives_the_golden_cases_resources(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    objects, telemetry, document = split_case("telemetry-weights", tmp_path)
    code, out, err = run(
        capsys,
        *("translate", "-f", str(objects), "--telemetry", str(telemetry)),
        *("--now", str(document["now"]), "-o", "json"),
    )
    assert code == 0, err
    fleets = json.loads(out)
    assert fleets == render_input(load_case("telemetry-weights"))["fleets"]
    # The busy replica gets a tenth of the idle one's weight; stale and silent ones keep theirs.
    assert eds_weights(fleets) == {
        "10.0.0.1": 100,
        "10.0.0.2": 10,
        "10.0.0.3": 100,
        "10.0.0.4": 50,
    }


def test_without_now_the_newest_record_sets_the_clock(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    objects, telemetry, _ = split_case("telemetry-weights", tmp_path)
    code, out, err = run(
        capsys, "translate", "-f", str(objects), "--telemetry", str(telemetry), "-o", "json"
    )
    assert code == 0, err
    assert eds_weights(json.loads(out))["10.0.0.2"] == 10
    # A clock long after the records: every record stale, static weights everywhere.
    code, out, err = run(
        capsys,
        *("translate", "-f", str(objects), "--telemetry", str(telemetry)),
        *("--now", "5000", "-o", "json"),
    )
    assert code == 0, err
    assert set(eds_weights(json.loads(out)).values()) == {100, 50}


def test_a_golden_input_file_works_as_the_telemetry_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    objects, _, _ = split_case("saturated-twin", tmp_path)
    case_file = Path(__file__).parent / "golden" / "in" / "saturated-twin.yaml"
    code, out, err = run(
        capsys, "translate", "-f", str(objects), "--telemetry", str(case_file), "-o", "json"
    )
    assert code == 0, err
    routes = json.loads(out)["default"]["routes"]
    clusters = [
        route["route"]["cluster"]
        for config in routes
        for vhost in config["virtualHosts"]
        for route in vhost["routes"]
        if "cluster" in route.get("route", {})
    ]
    assert "live/chat/affinity-saturated" in clusters
    assert "live/chat/affinity" not in clusters


def test_diff_prints_only_what_the_telemetry_changes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    objects, telemetry, _ = split_case("saturated-twin", tmp_path)
    code, out, err = run(
        capsys,
        *("translate", "-f", str(objects), "--telemetry", str(telemetry), "--diff", "-o", "json"),
    )
    assert code == 0, err
    changes = json.loads(out)
    assert [(c["fleet"], c["type"], c["change"]) for c in changes] == [
        ("default", "routes", "changed")
    ]
    assert "affinity-saturated" in json.dumps(changes[0]["after"])
    assert "affinity-saturated" not in json.dumps(changes[0]["before"])
    code, _, err = run(capsys, "translate", "-f", str(objects), "--diff")
    assert code == 1
    assert "--diff shows what --telemetry changes" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            {"mistral": {"10.0.0.1:8000": {"at": 1.0, "runing": 3}}},
            "telemetry.mistral.10.0.0.1:8000.runing: unknown telemetry field",
        ),
        (
            {"mistral": {"10.0.0.1:8000": {"at": 1.0, "kv_cache": -1}}},
            "telemetry.mistral.10.0.0.1:8000.kv_cache",
        ),
        ({"mistral": {"10.0.0.1:8000": {"running": 3}}}, "10.0.0.1:8000.at"),
        ({"mistral": ["10.0.0.1:8000"]}, "telemetry.mistral: must be a mapping"),
    ],
    ids=["misspelt field", "out of range", "no time", "not a mapping"],
)
def test_bad_telemetry_is_refused_naming_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: Any, message: str
) -> None:
    objects, _, _ = split_case("telemetry-weights", tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(content))
    code, out, err = run(capsys, "translate", "-f", str(objects), "--telemetry", str(bad))
    assert code == 1
    assert message in err
    assert out == ""


def test_a_missing_telemetry_file_is_an_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    objects, _, _ = split_case("telemetry-weights", tmp_path)
    code, out, err = run(
        capsys, "translate", "-f", str(objects), "--telemetry", str(tmp_path / "nope.json")
    )
    assert code == 1
    assert "nope.json" in err
    assert out == ""


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"objects": [], "clock": 1}, "clock: unknown key"),
        ({"now": "soon"}, "now: must be a number"),
        ({"objects": [{"kind": "Pool", "metadata": {"name": "p"}}]}, "objects[0].spec"),
        ({"endpoints": {"p": [{"address": "10.0.0.1", "port": 0}]}}, "endpoints.p[0].port"),
        (
            {"history": [{"now": 1, "telemetry": {"p": {"a:1": {}}}}]},
            "history[0].telemetry.p.a:1.at",
        ),
        ({"history": [{"at": 1}]}, "history[0]: must be a mapping with now and telemetry"),
    ],
    ids=["unknown key", "clock", "object", "endpoint", "history record", "history round"],
)
def test_a_bad_render_input_names_the_field(document: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_render_input(document, source="case.yaml")
    assert message in str(caught.value)
    assert str(caught.value).startswith("case.yaml: ")
