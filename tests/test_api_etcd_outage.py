"""The REST API while etcd is frozen or down: unknown write outcomes and stale reads say so."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from harness.api import Harness, running_api
from harness.builders import pool
from harness.processes import frozen
from harness.wait import poll

from controlplane.local import EmbeddedEtcd

pytestmark = pytest.mark.e2e


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own: it gets frozen and stopped."""
    server = EmbeddedEtcd(tmp_path, extra_args=["--unsafe-no-fsync"]).start()
    yield server
    with contextlib.suppress(ProcessLookupError, TypeError):
        os.kill(server.pid, signal.SIGCONT)  # type: ignore[arg-type]
    server.stop()


@pytest.fixture
async def api(own_etcd: EmbeddedEtcd, etcd_prefix: str) -> AsyncIterator[Harness]:
    async with running_api(own_etcd.endpoint, etcd_prefix) as harness:
        harness.client.timeout = 1.0
        yield harness


async def test_a_write_etcd_never_confirmed_says_its_outcome_is_unknown_and_how_to_check(
    api: Harness, own_etcd: EmbeddedEtcd
) -> None:
    created = await api.http.post("/v1/pools", json=pool("chat"))
    assert created.status_code == 201
    etag = created.headers["etag"]
    with frozen(own_etcd):
        response = await api.http.put(
            "/v1/pools/chat", json=pool("chat", [9001]), headers={"If-Match": etag}
        )
        unregistered = await api.http.put(
            "/v1/pools/chat/endpoints/e1", json={"address": "10.0.0.1", "port": 8000}
        )
    assert response.status_code == 503, response.text
    detail = response.json()["detail"]
    assert "unknown" in detail and "GET /v1/pools/chat" in detail and "ETag" in detail
    assert unregistered.status_code == 503
    assert "GET /v1/pools/chat/endpoints" in unregistered.json()["detail"]


async def test_reads_during_an_outage_come_from_the_mirror_marked_stale(
    api: Harness, own_etcd: EmbeddedEtcd
) -> None:
    created = await api.http.post("/v1/pools", json=pool("chat"))
    assert created.status_code == 201
    registered = await api.http.put(
        "/v1/pools/chat/endpoints/e1", json={"address": "10.0.0.1", "port": 8000}
    )
    assert registered.status_code == 200
    revision = registered.json()["revision"]

    # The mirror has seen everything written so far.
    async def mirrored() -> bool:
        status = (await api.http.get("/v1/status")).json()
        return bool(status["lastBuild"]["revision"] >= revision)

    await poll(mirrored, 10, message="the mirror to see the registration")
    fresh = await api.http.get("/v1/pools/chat")
    assert "x-kvpilot-stale" not in fresh.headers

    stopped = time.monotonic()
    own_etcd.stop()
    one = await api.http.get("/v1/pools/chat")
    outage = time.monotonic() - stopped
    assert one.status_code == 200, one.text
    assert one.json() == created.json()
    assert one.headers["etag"] == created.headers["etag"]
    assert one.headers["x-kvpilot-stale"] == "true"
    assert int(one.headers["x-kvpilot-mirror-revision"]) >= revision
    # Whole seconds since the watch broke: at most the time since etcd was stopped.
    assert one.headers["age"].isdigit() and int(one.headers["age"]) <= outage, one.headers
    listed = await api.http.get("/v1/pools")
    assert listed.status_code == 200 and listed.headers["x-kvpilot-stale"] == "true"
    assert [item["metadata"]["name"] for item in listed.json()["items"]] == ["chat"]
    endpoints = await api.http.get("/v1/pools/chat/endpoints")
    assert endpoints.status_code == 200 and endpoints.headers["x-kvpilot-stale"] == "true"
    assert [item["id"] for item in endpoints.json()["items"]] == ["e1"]
    missing = await api.http.get("/v1/pools/nope")
    assert missing.status_code == 404 and missing.headers["x-kvpilot-stale"] == "true"
    # Writes still fail: nothing is accepted that etcd did not confirm.
    write = await api.http.put("/v1/pools/other", json=pool("other"))
    assert write.status_code == 503
