"""`kvpilot` end to end: offline translate, and apply/get/set-weight/delete/status against a
running API (uvicorn on a free port, backed by a real etcd)."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import yaml
from harness.api import running_api
from harness.auth import ADMIN_TOKEN, READ_TOKEN
from harness.wait import wait_until

from commands.cli import main
from controlplane.local import EmbeddedEtcd, free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "policies" / "examples"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- offline ------------------------------------------------------------------------------------


def test_dash_reads_the_policy_from_standard_input_and_names_it_in_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = (EXAMPLES / "demo.yaml").read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(demo)))
    code, out, err = run(capsys, "translate", "-f", "-", "-o", "json")
    assert code == 0, err
    assert "demo/chat" in [c["name"] for c in json.loads(out)["default"]["clusters"]]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"kind: Pool\n")))
    code, _, err = run(capsys, "translate", "-f", "-")
    assert code == 1 and "<stdin> (document 1)" in err, err


def test_translate_prints_the_envoy_resources_of_the_examples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "translate", "-f", str(EXAMPLES))
    assert code == 0, err
    fleets = yaml.safe_load(out)
    assert "demo/chat" in [c["name"] for c in fleets["default"]["clusters"]]
    assert "listener-10000" in [listener["name"] for listener in fleets["default"]["listeners"]]


def test_translate_json_for_one_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "translate", "-f", str(EXAMPLES / "demo.yaml"), "--fleet", "default", "-o", "json"
    )
    assert code == 0
    assert set(json.loads(out)) == {"default"}
    code, _, err = run(capsys, "translate", "-f", str(EXAMPLES), "--fleet", "nope")
    assert code == 1
    assert err.startswith("error: fleet 'nope'")


def test_invalid_files_report_every_problem_with_file_document_and_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "kind: Pool\nmetadata: {name: a}\nspec: {endpoints: [{address: x, port: 0}]}\n"
        "---\nkind: RoutingPolicy\nmetadata: {name: r}\nspec: {routes: []}\n"
    )
    code, out, err = run(capsys, "translate", "-f", str(bad))
    assert code == 1
    assert f"{bad} (document 1): spec.endpoints[0].port" in err
    assert f"{bad} (document 2): spec.routes" in err
    assert out == ""


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["get"])
    assert info.value.code == 2


def test_unreachable_server_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "--server", f"http://127.0.0.1:{free_port()}", "get", "pools")
    assert code == 1
    assert err.count("\n") == 1 and "cannot reach kvpilot" in err


# -- against a running API ----------------------------------------------------------------------


@pytest.fixture
def server(etcd: EmbeddedEtcd, etcd_prefix: str) -> Iterator[str]:
    port = free_port()
    holder: dict[str, Any] = {}

    async def serve() -> None:
        async with running_api(etcd.endpoint, etcd_prefix) as harness:
            config = uvicorn.Config(
                harness.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
            )
            holder["server"] = uvicorn.Server(config)
            await holder["server"].serve()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    wait_until(lambda: holder.get("server") and holder["server"].started, 15, message="API up")
    yield f"http://127.0.0.1:{port}"
    holder["server"].should_exit = True
    thread.join(15)


@pytest.mark.e2e
def test_apply_get_set_weight_delete_and_status(
    server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPILOT_SERVER", server)
    monkeypatch.setenv("KVPILOT_TOKEN", ADMIN_TOKEN)

    code, out, err = run(capsys, "apply", "-f", str(EXAMPLES / "demo.yaml"))
    assert code == 0, err
    assert out.splitlines() == ["pool/demo-pool created", "routingpolicy/demo created"]
    code, out, _ = run(capsys, "apply", "-f", str(EXAMPLES / "demo.yaml"))
    assert out.splitlines() == ["pool/demo-pool unchanged", "routingpolicy/demo unchanged"]

    code, out, _ = run(capsys, "get", "pool", "demo-pool", "-o", "yaml")
    assert code == 0
    assert yaml.safe_load(out)["spec"]["models"] == ["demo-model"]
    code, out, _ = run(capsys, "get", "routingpolicies", "-o", "json")
    assert [i["metadata"]["name"] for i in json.loads(out)["items"]] == ["demo"]

    code, out, err = run(capsys, "set-weight", "demo-pool", "127.0.0.1:8001", "700")
    assert code == 0, err
    assert "weight 700" in out
    code, out, _ = run(capsys, "get", "pools", "-o", "yaml")
    (pool,) = list(yaml.safe_load_all(out))
    assert [e["weight"] for e in pool["spec"]["endpoints"]] == [700, 100, 100]

    code, out, err = run(capsys, "drain", "demo-pool", "127.0.0.1:8002")
    assert code == 0, err
    assert "draining: no new request or session" in out
    code, out, _ = run(capsys, "get", "pools", "-o", "yaml")
    (pool,) = list(yaml.safe_load_all(out))
    assert [e.get("health", "healthy") for e in pool["spec"]["endpoints"]] == [
        "healthy",
        "draining",
        "healthy",
    ]
    code, out, err = run(capsys, "drain", "demo-pool", "127.0.0.1:8009")
    assert code == 1 and "has no endpoint" in err
    code, out, err = run(capsys, "drain", "--undo", "demo-pool", "127.0.0.1:8002")
    assert code == 0 and "back in rotation" in out, err
    code, out, _ = run(capsys, "apply", "-f", str(EXAMPLES / "demo.yaml"))
    assert out.splitlines()[0] == "pool/demo-pool configured"

    code, out, err = run(capsys, "status")
    assert code == 0, err
    assert "Envoys connected: 0" in out
    assert "NODE" in out

    code, _, err = run(capsys, "--token", READ_TOKEN, "delete", "pool", "demo-pool")
    assert code == 1
    assert "needs role 'admin'" in err
    code, out, _ = run(capsys, "delete", "pool", "demo-pool")
    assert out.strip() == "pool/demo-pool deleted"
    code, _, err = run(capsys, "get", "pool", "demo-pool")
    assert code == 1
    assert "does not exist" in err

    # Every write above is in the audit log, newest first, under the admin token's name.
    code, out, err = run(capsys, "audit")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["WHEN", "WHO", "ACTION", "OBJECT", "REVISION", "CHANGES"]
    assert "delete" in lines[1] and "Pool/demo-pool" in lines[1]
    weight = next(line for line in lines if "/spec/endpoints/0/weight: 100 -> 700" in line)
    assert " ops " in weight and " replace " in weight
    code, out, _ = run(capsys, "audit", "-o", "json", "--limit", "2")
    assert [e["action"] for e in json.loads(out)] == ["delete", "replace"]


@pytest.mark.e2e
def test_apply_refuses_invalid_files_before_writing_anything(
    server: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = (EXAMPLES / "demo.yaml").read_text()
    (tmp_path / "all.yaml").write_text(good + "\n---\nkind: Fleet\nmetadata: {name: Bad_Name}\n")
    code, out, err = run(
        capsys, "--server", server, "--token", ADMIN_TOKEN, "apply", "-f", str(tmp_path)
    )
    assert code == 1
    assert "(document 3): metadata.name" in err
    assert out == ""
    code, out, _ = run(
        capsys, "--server", server, "--token", ADMIN_TOKEN, "get", "pools", "-o", "json"
    )
    assert json.loads(out)["items"] == []


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("latin1.yaml", b"kind: Pool\nmetadata: {name: caf\xe9}\n", "not UTF-8"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nested"),
        ("deep.yaml", b"a: " + b"[" * 100_000 + b"]" * 100_000, "nested"),
    ],
)
@pytest.mark.parametrize("command", ["translate", "apply"])
def test_files_kvpilot_cannot_read_are_one_clear_error_and_exit_1(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    command: str,
    name: str,
    content: bytes,
    expected: str,
) -> None:
    bad = tmp_path / name
    bad.write_bytes(content)
    server = ["--server", f"http://127.0.0.1:{free_port()}"] if command == "apply" else []
    code, out, err = run(capsys, *server, command, "-f", str(bad))
    assert code == 1
    assert str(bad) in err and expected in err, err
    assert "Traceback" not in err and out == ""


# -- output formats, diff, status --watch, apply --wait ------------------------------------------


@pytest.mark.e2e
def test_get_prints_tables_yaml_and_json(
    server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPILOT_SERVER", server)
    monkeypatch.setenv("KVPILOT_TOKEN", READ_TOKEN)
    assert run(capsys, "--token", ADMIN_TOKEN, "apply", "-f", str(EXAMPLES / "demo.yaml"))[0] == 0

    code, out, err = run(capsys, "get", "pools")
    assert code == 0, err
    header, row = out.splitlines()
    assert header.split() == ["NAME", "MODELS", "ENDPOINTS", "PROTOCOL", "EXTERNAL", "PRICE"]
    assert row.split() == ["demo-pool", "demo-model", "3", "http1", "no", "-"]
    code, out, _ = run(capsys, "get", "rp", "demo")
    assert out.splitlines()[1].split()[:2] == ["demo", "0.0.0.0:10000"]
    code, out, _ = run(capsys, "get", "pool", "demo-pool", "-o", "yaml")
    assert yaml.safe_load(out)["metadata"]["name"] == "demo-pool"
    code, out, _ = run(capsys, "get", "pools", "-o", "json")
    assert [item["metadata"]["name"] for item in json.loads(out)["items"]] == ["demo-pool"]

    def endpoints_table() -> list[list[str]]:
        _, out, _ = run(capsys, "get", "endpoints")
        return [line.split() for line in out.splitlines()]

    rows = wait_until(lambda: len(endpoints_table()) == 4 and endpoints_table(), 10)
    assert rows[0][:5] == ["POOL", "ENDPOINT", "HEALTH", "WEIGHT", "SENT"]
    assert rows[1][:5] == ["demo-pool", "127.0.0.1:8001", "healthy", "100", "100"]
    code, out, _ = run(capsys, "get", "endpoints", "demo-pool", "-o", "json")
    assert len(json.loads(out)["pools"][0]["endpoints"]) == 3


@pytest.mark.e2e
def test_diff_shows_the_envoy_resources_a_file_would_change_and_writes_nothing(
    server: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    common = ("--server", server, "--token", ADMIN_TOKEN)
    demo = EXAMPLES / "demo.yaml"
    code, out, err = run(capsys, *common, "diff", "-f", str(demo))
    assert code == 0, err
    assert "pool/demo-pool would be created" in out
    assert "+++ fleet default clusters demo/chat (after apply)" in out

    assert run(capsys, *common, "apply", "-f", str(demo))[0] == 0
    code, out, _ = run(capsys, *common, "diff", "-f", str(demo))
    assert "pool/demo-pool would be unchanged" in out
    assert out.rstrip().endswith("no change to any Envoy's configuration")

    documents = list(yaml.safe_load_all(demo.read_text()))
    documents[0]["spec"]["endpoints"][0]["weight"] = 700
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump_all(documents))
    code, out, _ = run(capsys, *common, "diff", "-f", str(changed))
    assert "pool/demo-pool would be configured" in out
    # In Envoy terms: one ClusterLoadAssignment changes, and only weights in it: the
    # endpoint's, and its pool's locality weight (the sum of the pool's endpoints).
    assert "--- fleet default endpoints demo/chat (now)" in out
    removed = [line for line in out.splitlines() if line.startswith("- ")]
    added = [line for line in out.splitlines() if line.startswith("+ ")]
    assert [line.split()[1] for line in removed] == ["loadBalancingWeight:"] * 2
    assert sorted(line.split()[1:] for line in added) == [
        ["loadBalancingWeight:", "700"],
        ["loadBalancingWeight:", "900"],
    ]
    assert out.rstrip().endswith("Envoy resources: 1 changed")
    code, out, _ = run(capsys, *common, "get", "pool", "demo-pool", "-o", "json")
    assert json.loads(out)["spec"]["endpoints"][0]["weight"] == 100


@pytest.mark.e2e
def test_status_watch_redraws_until_interrupted(server: str) -> None:
    import signal
    import subprocess
    import sys

    # The worst a parent can hand down (a test runner's worker did): SIGINT ignored and
    # blocked, which both survive exec. Ctrl-C must end the watch anyway. A small program
    # sets them and execs the command: a preexec_fn would run Python in the child of this
    # multi-threaded process (gRPC's threads), which crashed it once.
    deaf_ear = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", deaf_ear, sys.executable, "-m", "commands.cli",
         "--server", server, "--token", READ_TOKEN, "status", "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        frames = 0
        while frames < 3:
            line = process.stdout.readline()
            assert line, "status --watch ended early"
            frames += line.startswith("--- ")
        process.send_signal(signal.SIGINT)
        # Keep reading while it stops: a frame written meanwhile into a pipe nobody reads
        # would hold the process at its final flush.
        process.communicate(timeout=30)
        assert process.returncode == 0
    finally:
        process.kill()
        process.wait()


@pytest.mark.e2e
def test_apply_wait_shows_progress_until_every_envoy_acks_and_fails_on_a_nack(
    kvpilot_factory: Any,
    envoy_factory: Any,
    etcd_prefix: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    import socket

    kvpilot = kvpilot_factory(etcd_prefix)
    for index in range(2):
        envoy_factory(xds_port=kvpilot.xds_port, node_id=f"wait-{index}")
    common = ("--server", kvpilot.api_url, "--token", ADMIN_TOKEN)
    wait_until(
        lambda: len(json.loads(run(capsys, *common, "status", "-o", "json")[1])["envoys"]) == 2,
        15,
        message="both Envoys connected",
    )
    documents = list(yaml.safe_load_all((EXAMPLES / "demo.yaml").read_text()))
    documents[1]["spec"]["listener"] = {"address": "127.0.0.1", "port": free_port()}
    demo = tmp_path / "demo.yaml"
    demo.write_text(yaml.safe_dump_all(documents))
    code, out, err = run(capsys, *common, "apply", "-f", str(demo), "--wait")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:2] == ["pool/demo-pool created", "routingpolicy/demo created"]
    assert lines[-1].startswith("all 2 Envoys run revision ")
    assert any(line.startswith("[") and "Envoys ACKed" in line for line in lines)

    # A listener port something else holds: Envoy rejects it, and --wait says so.
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    documents[1]["spec"]["listener"]["port"] = blocker.getsockname()[1]
    busy = tmp_path / "busy.yaml"
    busy.write_text(yaml.safe_dump_all(documents))
    try:
        code, out, err = run(capsys, *common, "apply", "-f", str(busy), "--wait", "--timeout", "20")
    finally:
        blocker.close()
    assert code == 1
    assert "rejected the new LDS configuration" in err and "Address already in use" in err
