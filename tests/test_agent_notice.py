"""The agent's preemption notice sources and its regions flags: a notice from a stand-in
metadata service (on 127.0.0.1, never a cloud address) or a file drains the registration in
a real etcd; bad region, zone or capacity flags are refused before anything is written."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.agent import MetricsBackend
from harness.wait import poll

from commands.agent import add_arguments, config_from_args
from controlplane.agent.notice import AWS_NOTICE_PATH, GCP_NOTICE_PATH, NoticeSource
from controlplane.agent.scrape import Agent
from controlplane.etcd import EtcdClient
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd


class Metadata:
    """A cloud metadata service stand-in: AWS's IMDSv2 token and spot instance-action, and
    GCP's preempted flag (which needs its Metadata-Flavor header)."""

    def __init__(self) -> None:
        self.notice = False
        self.tokens_asked = 0

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        metadata = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: str) -> None:
                payload = body.encode()
                self.send_response(status)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_PUT(self) -> None:
                metadata.tokens_asked += 1
                self._send(200, "token-1")

            def do_GET(self) -> None:
                if self.path == AWS_NOTICE_PATH:
                    if self.headers.get("X-aws-ec2-metadata-token") != "token-1":
                        self._send(401, "")
                    elif metadata.notice:
                        self._send(200, '{"action": "terminate", "time": "2026-12-03T17:00:00Z"}')
                    else:
                        self._send(404, "")
                elif self.path == GCP_NOTICE_PATH:
                    if self.headers.get("Metadata-Flavor") != "Google":
                        self._send(403, "")
                    else:
                        self._send(200, "TRUE" if metadata.notice else "FALSE")
                else:
                    self._send(404, "")

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize("kind", ["aws", "gcp"])
async def test_metadata_sources_say_nothing_until_the_notice(kind: str) -> None:
    metadata = Metadata()
    with metadata.serve() as url:
        source = NoticeSource.parse(kind, url)
        async with httpx.AsyncClient() as http:
            assert await source.noticed(http) is None
            metadata.notice = True
            said = await source.noticed(http)
    assert said is not None and ("terminate" in said or said == "TRUE")
    assert kind == "gcp" or metadata.tokens_asked == 2


async def test_an_unreachable_source_means_no_notice(unused_tcp_port: int) -> None:
    source = NoticeSource.parse(f"http://127.0.0.1:{unused_tcp_port}/notice")
    async with httpx.AsyncClient() as http:
        assert await source.noticed(http) is None


@pytest.fixture
async def store(etcd: EmbeddedEtcd, etcd_prefix: str) -> AsyncIterator[Store]:
    client = EtcdClient([etcd.endpoint])
    await client.connect()
    yield Store(client, etcd_prefix)
    await client.close()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.e2e
@pytest.mark.parametrize("source", ["aws", "file"])
async def test_a_notice_drains_the_registration_and_keeps_its_place(
    source: str,
    store: Store,
    metrics_backends: Callable[..., MetricsBackend],
    tmp_path: Path,
) -> None:
    backend = metrics_backends()
    metadata = Metadata()
    notice_file = tmp_path / "preempted"
    with metadata.serve() as url:
        flag = "aws" if source == "aws" else f"file:{notice_file}"
        config = config_from_args(
            _args(
                *("--pool", "llama", "--backend", backend.url, "--register"),
                *("--region", "us-east", "--zone", "us-east-a", "--capacity", "spot"),
                *("--preemption-notice", flag, "--metadata-url", url),
                *("--notice-interval", "0.1", "--interval", "0.1", "--etcd-endpoints", "x:1"),
            )
        )
        agent = Agent(store, config)
        task = asyncio.create_task(agent.run())
        key = store.keys.absolute(f"endpoints/llama/127.0.0.1:{backend.port}")

        async def registration() -> dict[str, Any] | None:
            kv = await store.client.get(key)
            return json.loads(kv.value) if kv is not None else None

        try:
            first = await poll(registration, message="the registration")
            assert first["locality"] == {"region": "us-east", "zone": "us-east-a"}
            assert first["capacity"] == "spot" and "health" not in first
            if source == "aws":
                metadata.notice = True
            else:
                notice_file.write_text("terminate at 17:00\n")

            async def draining() -> bool:
                body = await registration()
                return body is not None and body.get("health") == "draining"

            await poll(draining, message="the registration to turn draining")
            assert agent.notice is not None
            body = await registration()
            assert body is not None and body["capacity"] == "spot"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--zone", "us-east-a"), "--zone: .*has no region"),
        (("--region", "us east"), "--region"),
        (("--preemption-notice", "azure"), "use aws, gcp, file:PATH"),
        (("--preemption-notice", "file:"), "needs a path"),
        (("--notice-interval", "0"), "--notice-interval"),
    ],
    ids=["zone without region", "bad region", "unknown source", "file without path", "interval"],
)
def test_bad_regions_flags_get_a_sentence(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(_args("--pool", "p", "--backend", "http://10.0.0.1:8000", *argv))


def test_an_unknown_capacity_kind_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        _args("--pool", "p", "--backend", "http://10.0.0.1:8000", "--capacity", "preemptible")


def test_a_targets_file_entry_with_an_unknown_capacity_is_refused(tmp_path: Path) -> None:
    targets = tmp_path / "targets.yaml"
    targets.write_text("- {pool: a, url: 'http://10.0.0.1:8000', capacity: preemptible}\n")
    with pytest.raises(ValueError, match="--capacity"):
        config_from_args(_args("--targets-file", str(targets)))
