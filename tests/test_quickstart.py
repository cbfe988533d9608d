"""docs/quickstart.md is a test: its `sh quickstart` blocks run verbatim, in order, in one
shell, from a fresh virtualenv (`pip install '.[local]'` of a copy of this checkout), and a
chat completion must come back through Envoy from a replica the agent registered, with the
Envoy's ADS stream on mutual TLS and bound to its certificate's identity.

What the test adds to the page, and nothing else:
- the ports: the page reads them from shell variables with defaults, and the test sets every
  one to a free port;
- pip's source: a wheelhouse of the `[local]` extra's wheels, filled once per pyproject.toml
  (`pip download`, cached under `.venv/`), so a run installs without the network in about a
  minute; `PIP_NO_INDEX` and `PIP_FIND_LINKS` point pip at it, the command stays the page's;
- a human's pace: after the block that starts kvpilot it waits for `/readyz` (a person reads
  the log line first), and after the replicas' block for their `/health`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.wait import wait_until

from controlplane.local import free_port, repo_root

QUICKSTART = repo_root() / "docs" / "quickstart.md"
BLOCK = re.compile(r"^```sh quickstart\n(.*?)^```", re.MULTILINE | re.DOTALL)
PORTS = (
    "API_PORT",
    "XDS_PORT",
    "ETCD_PORT",
    "ENVOY_PORT",
    "ENVOY_ADMIN_PORT",
    "VLLM_A_PORT",
    "VLLM_B_PORT",
)
WHEELHOUSE = repo_root() / ".venv" / "quickstart-wheelhouse"
SKIP_COPY = shutil.ignore_patterns(
    ".git", ".venv", "*.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache",
    ".ruff_cache", ".state", "build", "results", "artifacts", "kvpilot-venv", "kvpilot-certs",
    "kvpilot-state", "*.log",
)  # fmt: skip


def quickstart_blocks(text: str) -> list[str]:
    """The command blocks the page marks as the quickstart (```sh quickstart), in order."""
    return [match.group(1) for match in BLOCK.finditer(text)]


def test_the_page_has_six_commands_between_install_and_envoy() -> None:
    """The six documented steps, each one command: install, certs, serve, agent, apply, envoy
    (beside them the ports line, the simulated replicas and the request)."""
    blocks = quickstart_blocks(QUICKSTART.read_text())
    firsts = [block.split()[0] for block in blocks]
    steps = [b for b in blocks if b.startswith(("python3 -m venv", "kvpilot ", "envoy "))]
    assert len(steps) == 6, firsts
    assert firsts == [":", "python3", "python", "kvpilot", "kvpilot", "kvpilot", "kvpilot",
                      "envoy", "curl"]  # fmt: skip
    for port in PORTS:
        assert f"${{{port}:=" in blocks[0], f"the ports line gives {port} a default"


def test_the_readme_s_six_commands_are_the_quickstart_s() -> None:
    """README's path to a real fleet is the tested quickstart without the simulated replicas:
    the same six commands in the same order (a command being its first two words)."""
    readme = (repo_root() / "README.md").read_text()
    section = readme.split("## To a real fleet in six commands", 1)[1]
    block = re.search(r"^```sh\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert block is not None
    commands = [line for line in block.group(1).splitlines() if line and not line[0].isspace()]
    assert len(commands) == 6, commands
    steps = [
        b
        for b in quickstart_blocks(QUICKSTART.read_text())
        if b.startswith(("python3 -m venv", "kvpilot ", "envoy "))
    ]

    def words(command: str) -> list[str]:
        # Environment assignments and the virtualenv's set-up are not the command.
        tokens = [t for t in command.split() if "=" not in t or t.startswith("-")]
        for option in ("--token", "--server"):  # kvpilot's global options
            if option in tokens:
                at = tokens.index(option)
                del tokens[at : at + 2]
        if "pip" in tokens:
            tokens = tokens[tokens.index("pip") :]
        return tokens[:2]

    assert [words(c) for c in commands] == [words(s) for s in steps]


def _wheelhouse() -> Path:
    """Wheels for `pip install '.[local]'` (and the build backend), fetched once per
    pyproject.toml, so the fresh virtualenv installs offline."""
    digest = hashlib.sha256((repo_root() / "pyproject.toml").read_bytes()).hexdigest()
    stamp = WHEELHOUSE / f".pyproject-{digest[:16]}"
    if not stamp.exists():
        shutil.rmtree(WHEELHOUSE, ignore_errors=True)
        WHEELHOUSE.mkdir(parents=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(WHEELHOUSE),
             ".[local]", "setuptools>=68", "wheel"],
            cwd=repo_root(), check=True, timeout=600,
        )  # fmt: skip
        stamp.touch()
    return WHEELHOUSE


class Shell:
    """One bash reading the page's blocks on stdin, as a person pastes them into a terminal:
    `. activate`, exports and background jobs carry over from block to block."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.output: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        self.process = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=cwd, env=env, text=True, start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def run(self, block: str, index: int, timeout: float) -> list[str]:
        """Run one block; its output lines. Fails naming the block when it exits non-zero."""
        assert self.process.stdin is not None
        sentinel = f"__quickstart_block_{index}_done__"
        # The status first, then a newline: the block's last line may not end with one.
        self.process.stdin.write(f'{block}\n__status=$?; echo; echo "{sentinel} $__status"\n')
        self.process.stdin.flush()
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"block {index} still running after {timeout} s:\n{block}")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.process.poll() is not None:
                    raise AssertionError(f"the shell died in block {index}:\n{block}") from None
                continue
            self.output.append(line)
            if line.startswith(sentinel):
                code = int(line.split()[-1])
                assert code == 0, f"block {index} exited {code}:\n{block}\n{''.join(lines)}"
                return lines
            lines.append(line)

    def stop(self) -> None:
        """End the shell and every job it started (they share its process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
        # Daemons outlive bash for a moment after SIGTERM; give them the same end.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


@contextlib.contextmanager
def _shell(cwd: Path, env: dict[str, str]) -> Iterator[Shell]:
    shell = Shell(cwd, env)
    try:
        yield shell
    finally:
        shell.stop()


def _logs(checkout: Path) -> str:
    """The daemons' logs, for a failure message."""
    parts = []
    for name in ("kvpilot.log", "agent.log", "envoy.log", "replicas.log"):
        path = checkout / name
        if path.exists():
            parts.append(
                f"--- {name} (last 40 lines)\n" + "\n".join(path.read_text().splitlines()[-40:])
            )
        else:
            parts.append(f"--- {name}: not written")
    return "\n".join(parts)


def _quiet_ports(count: int) -> list[int]:
    """Free ports below the kernel's ephemeral range. The quickstart binds its ports a minute
    or more after they are picked (the install comes first); a port from the ephemeral range
    (what `free_port` gives) can meanwhile be handed to another test's socket, while a port
    below it is only ever taken by a program that asks for it by number."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = random.Random().sample(range(max(1024, low - 12000), low), 200)
    chosen: list[int] = []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    return [free_port() for _ in range(count)]


@pytest.mark.e2e
@pytest.mark.quickstart
@pytest.mark.timeout(900)
def test_quickstart_from_a_fresh_virtualenv_to_a_chat_completion_over_mutual_tls(
    tmp_path: Path,
) -> None:
    blocks = quickstart_blocks(QUICKSTART.read_text())
    wheelhouse = _wheelhouse()
    checkout = tmp_path / "kvpilot"
    shutil.copytree(repo_root(), checkout, ignore=SKIP_COPY, symlinks=True)
    ports = dict(zip(PORTS, _quiet_ports(len(PORTS)), strict=True))
    ours = str(Path(sys.executable).parent)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("KVPILOT_", "PYTEST_")) and key not in {"VIRTUAL_ENV", "PYTHONPATH"}
    }
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != ours)
    env.update({name: str(port) for name, port in ports.items()})
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse), PIP_DISABLE_PIP_VERSION_CHECK="1")
    api = f"http://127.0.0.1:{ports['API_PORT']}"

    with _shell(checkout, env) as shell:
        try:
            answer: list[str] = []
            for index, block in enumerate(blocks):
                started = time.monotonic()
                lines = shell.run(block, index, timeout=600 if "pip install" in block else 180)
                print(f"block {index} ({block.split()[0]}): {time.monotonic() - started:.1f} s")
                if block.startswith("python -m replicasim"):
                    for port in (ports["VLLM_A_PORT"], ports["VLLM_B_PORT"]):
                        wait_until(
                            lambda port=port: _ok(f"http://127.0.0.1:{port}/health"),
                            60,
                            message="the simulated replicas to listen",
                        )
                if block.startswith("kvpilot serve"):
                    wait_until(lambda: _ok(f"{api}/readyz"), 90, message="kvpilot's /readyz")
                if block.startswith("curl"):
                    answer = lines
            assert (checkout / "kvpilot-venv" / "bin" / "kvpilot").exists(), "a fresh virtualenv"
            body = json.loads([line for line in answer if line.strip()][-1])
            assert body["backend"] in {"vllm-0", "vllm-1"}, body
            assert body["choices"][0]["message"]["content"], body

            status = httpx.get(
                f"{api}/v1/status", headers={"authorization": "Bearer change-me"}, timeout=10
            ).json()
            (envoy,) = status["envoys"]
            assert envoy["fleet"] == "default", envoy
            # An identity is only known from a client certificate: the stream is mutual TLS.
            assert envoy["identity"] == "spiffe://kvpilot.local/fleet/default", envoy
            endpoints = httpx.get(
                f"{api}/v1/pools/llama/endpoints",
                headers={"authorization": "Bearer change-me"},
                timeout=10,
            ).json()
            registered = {f"127.0.0.1:{ports[p]}" for p in ("VLLM_A_PORT", "VLLM_B_PORT")}
            assert all(address in json.dumps(endpoints) for address in registered), endpoints
        except BaseException:
            print("".join(shell.output[-200:]))
            print(_logs(checkout))
            raise


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
