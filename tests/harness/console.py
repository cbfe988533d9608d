"""The operator's console in a real headless Chromium: the browser (Debian's package, driven
by Playwright, no browser download), the console rig (a live kvpilot with two Envoys in fleets
`default` and `edge`), and page helpers. Screenshots go to tests/artifacts/console/
(git-ignored) for a person to look at."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.etcd import EtcdClient
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEnvoy, EmbeddedEtcd, KvpilotProcess, free_port
from controlplane.local.replicas import BackendProcess
from harness.auth import ADMIN_TOKEN, TOKEN_ENV
from harness.builders import FAST_HEALTH_CHECK, policy, pool
from harness.envoy import envoy_hosts
from harness.wait import wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).parents[1] / "artifacts" / "console"
ONCALL = "oncall-alice"
ONCALL_TOKEN = "oncall-token-0123456789abcdef"
"""A named admin token (from a tokens file): the audit log records changes under its name."""


def chromium() -> Path:
    """Debian's chromium, installed on first use (the test machine may be fresh).

    Browser test modules run on several workers at once: the first to get here installs,
    the others wait on a lock for it (a second apt-get would fail at once on dpkg's lock)."""
    if not CHROMIUM.exists() and shutil.which("apt-get"):
        with open(Path(tempfile.gettempdir()) / "kvpilot-chromium-install.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not CHROMIUM.exists():
                subprocess.run(
                    "apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium",
                    shell=True,
                    capture_output=True,
                    timeout=600,
                    check=False,
                )
    if not CHROMIUM.exists():
        # A failure, not a skip: a run without its browser tests must not pass as green.
        pytest.fail(
            "Debian's chromium is not installed and `apt-get install chromium` failed "
            "(needs root and the Debian mirror); the console's browser tests cannot run",
            pytrace=False,
        )
    return CHROMIUM


@contextlib.contextmanager
def launched_browser() -> Iterator[Any]:
    """Headless Chromium under Playwright for the length of the block. Without Playwright or
    Chromium the test fails (a run that skipped its browser tests is not a pass)."""
    try:
        playwright_api = importlib.import_module("playwright.sync_api")
    except ImportError as error:
        pytest.fail(
            f"Playwright cannot be imported ({error}); install the dev extras "
            "(`make .venv/.installed`): the console's browser tests cannot run",
            pytrace=False,
        )
    executable = chromium()
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@dataclass
class Console:
    """A kvpilot with two Envoys (fleets `default` and `edge`) and three replicas behind a
    telemetry-balanced route."""

    kvpilot: KvpilotProcess
    envoys: list[EmbeddedEnvoy]
    backends: BackendProcess
    listener_port: int
    etcd: EmbeddedEtcd
    prefix: str

    @property
    def ports(self) -> list[int]:
        return [replica.port for replica in self.backends.replicas]

    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}/v1/chat/completions"

    def api(self, token: str = ADMIN_TOKEN) -> httpx.Client:
        return httpx.Client(
            base_url=self.kvpilot.api_url,
            headers={"authorization": f"Bearer {token}"},
            timeout=10,
        )

    def put_telemetry(self, pool: str, records: dict[int, dict[str, Any]]) -> None:
        """One telemetry record per replica port of `pool`, as `kvpilot agent` writes them."""

        async def write() -> None:
            client = EtcdClient([self.etcd.endpoint])
            await client.connect()
            try:
                store = Store(client, self.prefix)
                for port, record in records.items():
                    await store.put_telemetry(pool, f"127.0.0.1:{port}", record)
            finally:
                await client.close()

        # Playwright's sync API keeps an event loop running on this thread.
        with ThreadPoolExecutor(1) as worker:
            worker.submit(asyncio.run, write()).result()

    def write_raw(self, relative: str, value: bytes | None) -> None:
        """Write (or with None delete) one key under the rig's prefix past the REST API, as
        etcdctl or an older kvpilot would."""

        async def write() -> None:
            async with EtcdClient([self.etcd.endpoint]) as client:
                key = f"{self.prefix}/{relative}".encode()
                if value is None:
                    await client.delete(key)
                else:
                    await client.put(key, value)

        with ThreadPoolExecutor(1) as worker:
            worker.submit(asyncio.run, write()).result()

    def write_telemetry(self, rounds: int, interval: float) -> None:
        """Telemetry records for every replica, as an agent would write them."""

        async def write() -> None:
            client = EtcdClient([self.etcd.endpoint])
            await client.connect()
            store = Store(client, self.prefix)
            try:
                for round_ in range(rounds):
                    for index, port in enumerate(self.ports):
                        wave = (round_ + 3 * index) % 7
                        await store.put_telemetry(
                            "chat",
                            f"127.0.0.1:{port}",
                            {
                                "at": time.time(),
                                "waiting": float(wave + 4 * index),
                                "running": float(8 + wave),
                                "max_running": 32.0,
                                "kv_cache": min(0.97, 0.25 + 0.1 * wave + 0.2 * index),
                                "pending_tokens": float(1200 * (wave + 1)),
                            },
                        )
                    await asyncio.sleep(interval)
            finally:
                await client.close()

        asyncio.run(write())


@contextlib.contextmanager
def running_console(
    etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Console]:
    """The `Console` rig: kvpilot with a named admin token, three replicas behind the
    telemetry-balanced route `chat`, and the two Envoys seeing every replica healthy."""
    prefix = f"/kvpilot-console/{time.monotonic_ns()}"
    state_dir = tmp_path_factory.mktemp("kvpilot-console")
    # A named admin token besides the environment's, for the audit log's "who".
    tokens = state_dir / "tokens.yaml"
    entry = {"name": ONCALL, "role": "admin", "token": ONCALL_TOKEN}
    tokens.write_text(json.dumps({"tokens": [entry]}))
    kvpilot = KvpilotProcess(
        state_dir,
        etcd_endpoints=[etcd.endpoint],
        prefix=prefix,
        env=TOKEN_ENV,
        extra_args=["--tokens-file", str(tokens)],
    ).start()
    backends = BackendProcess(3, id_prefix="ui", state_dir=tmp_path_factory.mktemp("ui-be"))
    envoys: list[EmbeddedEnvoy] = []
    try:
        backends.start()
        listener_port = free_port()
        rig = Console(kvpilot, envoys, backends, listener_port, etcd, prefix)
        with rig.api() as api:
            for obj in (
                pool("chat", rig.ports, models=["sim-model"], health_check=FAST_HEALTH_CHECK),
                policy(
                    "inference",
                    listener_port,
                    [
                        {
                            "name": "chat",
                            "match": {"models": ["sim-model"]},
                            "balancing": "telemetry",
                            "rateLimit": {"requests": 500, "unit": "second"},
                            "tiers": [["chat"]],
                        }
                    ],
                ),
            ):
                kind = "pools" if obj["kind"] == "Pool" else "routingpolicies"
                response = api.put(f"/v1/{kind}/{obj['metadata']['name']}", json=obj)
                assert response.status_code in (200, 201), response.text
        for fleet in ("default", "edge"):
            envoys.append(
                EmbeddedEnvoy(
                    tmp_path_factory.mktemp(f"envoy-{fleet}"),
                    xds_address="127.0.0.1",
                    xds_port=kvpilot.xds_port,
                    node_id=f"envoy-{fleet}-1",
                    fleet=fleet,
                ).start()
            )
        wait_until(
            lambda: (
                {
                    port
                    for port, host in envoy_hosts(envoys[0], "inference/chat").items()
                    if host.get("health_flags") == "healthy"
                }
                == set(rig.ports)
            ),
            30,
            message="Envoy to see every replica healthy",
        )
        yield rig
    finally:
        for envoy in envoys:
            envoy.stop()
        backends.stop()
        kvpilot.stop()


def watch_errors(page: Any, errors: list[str] | None = None) -> list[str]:
    """Every error the browser reports on `page` from now on, appended as lines to `errors`
    (a new list by default) and returned: console errors, uncaught exceptions, requests that
    failed and responses with an HTTP error status (a missing /favicon.ico is one). Read it
    before closing the page: closing aborts the page's polls."""
    errors = [] if errors is None else errors
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: errors.append(f"exception: {e}"))
    page.on("requestfailed", lambda r: errors.append(f"failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and errors.append(f"HTTP {r.status}: {r.url}"))
    return errors


def open_console(
    browser: Any,
    rig_url: str,
    token: str,
    hash_: str = "endpoints",
    *,
    width: int = 1500,
    errors: list[str] | None = None,
) -> Any:
    """A fresh page `width` pixels wide signed in with `token` through the sign-in dialog;
    with `errors`, the browser's errors on it are appended there (`watch_errors`)."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    if errors is not None:
        watch_errors(page, errors)
    page.goto(f"{rig_url}/ui/#{hash_}")
    page.fill("#token", token)
    page.click("#signin-button")
    page.wait_for_selector("#who b", timeout=10_000)
    return page


def shoot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def row(page: Any, port: int) -> Any:
    return page.locator(f'[data-endpoint="127.0.0.1:{port}"]')
