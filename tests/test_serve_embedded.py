"""`kvpilot serve` on its embedded defaults tells where its etcd is, so agents can be pointed
at it; without an API token it says what to set before starting anything; and the daemons
keep HTTP client chatter out of their INFO logs."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from harness.auth import ADMIN, ADMIN_TOKEN
from harness.wait import wait_until

from controlplane.local import ManagedProcess, free_port, repo_root
from controlplane.logs import CHATTY_LOGGERS, setup_logging


@pytest.mark.e2e
def test_serve_prints_and_reports_the_embedded_etcd_address(tmp_path: Path) -> None:
    api_port, etcd_port = free_port(), free_port()
    stdout = tmp_path / "serve.out"
    process = ManagedProcess(
        [sys.executable, "-m", "commands.cli", "serve", "--state-dir", str(tmp_path),
         "--api-address", f"127.0.0.1:{api_port}", "--xds-address", f"127.0.0.1:{free_port()}", "--xds-insecure-plaintext",
         "--embedded-etcd-port", str(etcd_port)],
        tmp_path / "serve.log",
        stdout_path=stdout,
        env={"KVPILOT_ADMIN_TOKEN": ADMIN_TOKEN, "PATH": str(Path(sys.executable).parent)},
        cwd=repo_root(),
    )  # fmt: skip
    process.spawn()
    try:
        printed = wait_until(
            lambda: re.search(
                r"embedded etcd at (127\.0\.0\.1:\d+) \(point agents at it with "
                r"--etcd-endpoints \1\)",
                stdout.read_text() if stdout.exists() else "",
            ),
            30,
            message="serve to print the embedded etcd's address",
        )
        address = printed.group(1)
        assert address == f"127.0.0.1:{etcd_port}", "--embedded-etcd-port is the port etcd got"

        def status() -> dict[str, object] | None:
            response = httpx.get(f"http://127.0.0.1:{api_port}/v1/status", headers=ADMIN)
            return response.json() if response.status_code == 200 else None

        def watching() -> dict[str, object] | None:
            # /v1/status answers before the mirror's watch is up on a loaded machine.
            reported = status()
            return reported if reported and reported["etcd"]["watching"] else None  # type: ignore[index]

        reported = wait_until(watching, 30, message="/v1/status to report the watch up")
        assert reported["etcd"] == {"endpoints": [address], "embedded": True, "watching": True}
        # The address works: an agent could write there.
        assert httpx.get(f"http://{address}/health", timeout=5).json()["health"] == "true"
    finally:
        process.stop(10)


@pytest.mark.parametrize("tokens_file", [False, True], ids=["no-token", "unreadable-file"])
def test_serve_without_an_api_token_says_what_to_set_and_starts_nothing(
    tmp_path: Path, tokens_file: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPILOT_")}
    extra = ["--tokens-file", str(tmp_path / "missing.yaml")] if tokens_file else []
    result = subprocess.run(
        [sys.executable, "-m", "commands.cli", "serve", "--state-dir", str(tmp_path / "state"),
         "--api-address", f"127.0.0.1:{free_port()}", "--xds-address", f"127.0.0.1:{free_port()}",
         "--xds-insecure-plaintext", *extra],
        capture_output=True, text=True, env=env, cwd=repo_root(), timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    if tokens_file:
        assert lines[0].startswith("kvpilot serve: error: cannot read the tokens file")
    else:
        assert lines[0].startswith("kvpilot serve: error: no API tokens are configured")
        for what in ("KVPILOT_ADMIN_TOKEN", "--tokens-file", "--insecure-no-auth"):
            assert what in lines[0]
    assert not (tmp_path / "state").exists(), "no embedded etcd was started"


def test_http_client_request_logs_are_quiet_at_info_and_shown_at_debug() -> None:
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    try:
        root.handlers[:] = []  # basicConfig only configures a root logger without handlers
        setup_logging("info")
        assert all(
            logging.getLogger(n).getEffectiveLevel() == logging.WARNING for n in CHATTY_LOGGERS
        )
        assert logging.getLogger("kvpilot").isEnabledFor(logging.INFO)
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        root.handlers[:] = []
        setup_logging("debug")
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
