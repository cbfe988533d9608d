"""`kvpilot get` over every kind, and `kvpilot status` with a running rollout: each kind's
table has its own columns, `get --help` lists every kind from the registry, and status shows
the rollouts and the replica that drives them."""

from __future__ import annotations

from typing import Any

import pytest
from harness.auth import ADMIN_TOKEN
from harness.builders import policy, pool, rollout, route
from harness.rig import api_client, apply
from harness.wait import wait_until

from commands.cli import main
from commands.cli.tables import TABLES
from controlplane.local import free_port
from policies import KIND_PATHS


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_kind_has_its_own_table_and_get_help_lists_every_kind(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert set(TABLES) == set(KIND_PATHS)
    headers = [table.header for table in TABLES.values()]
    assert len(set(headers)) == len(headers), "two kinds share their columns"
    with pytest.raises(SystemExit) as exited:
        main(["get", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for kind, plural in KIND_PATHS.items():
        assert f"{kind.lower()} ({plural})" in text, kind
    assert "endpoints" in text


@pytest.mark.e2e
def test_get_rollouts_and_status_show_a_running_rollout_and_its_driver(
    etcd_prefix: str,
    kvpilot_factory: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kvpilot = kvpilot_factory(etcd_prefix)
    api = api_client(kvpilot)
    apply(
        api,
        pool("chat", [free_port()]),
        pool("next", [free_port()]),
        policy("main", free_port(), [route("chat", name="all")], fleets=["default", "edge"]),
        rollout(
            "canary",
            steps=[{"weight": 10, "minDuration": "1h"}, {"weight": 50}, {"weight": 100}],
            fleets=["edge"],
        ),
    )
    monkeypatch.setenv("KVPILOT_SERVER", kvpilot.api_url)
    monkeypatch.setenv("KVPILOT_TOKEN", ADMIN_TOKEN)

    code, out, err = run(capsys, "get", "rollouts")
    assert code == 0, err
    header, row = (line.split("  ") for line in out.splitlines())
    cells = [c.strip() for c in row if c.strip()]
    assert [c.strip() for c in header if c.strip()] == list(TABLES["Rollout"].header)
    assert cells == ["canary", "main/all", "chat", "next", "10%,50%,100%", "edge", "rollback"]

    def progressing() -> str | None:
        status = api.get("/v1/status").json()
        phases = [r.get("phase") for r in status["rollouts"]]
        return out if phases == ["Progressing"] and status["rolloutDriver"] else None

    wait_until(progressing, 30, message="the rollout to start, driven by this replica")
    code, out, err = run(capsys, "status")
    assert code == 0, err
    replica = api.get("/v1/status").json()["replica"]
    assert f"Rollouts: 1 (driven by replica {replica} since " in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Rollouts: 1"))
    assert lines[at + 1].split()[:4] == ["NAME", "TARGET", "PHASE", "STEP"]
    assert lines[at + 2].split()[:6] == [
        "canary",
        "main/all",
        "Progressing",
        "1/3",
        "chat=90%",
        "next=10%",
    ]
