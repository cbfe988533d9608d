"""The REST API in process, wired to a real etcd, a real Store and a running Reconciler, for
API tests that need no Envoy."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from api import ApiContext, create_app
from api.auth import AuthConfig, WriteRateLimit
from controlplane.audit import AuditLog
from controlplane.etcd import EtcdClient
from controlplane.etcd.store import Store
from controlplane.mirror import StateChange, StateMirror
from controlplane.reconcile.loop import Reconciler
from controlplane.reconcile.metrics import ReconcileMetrics
from harness.auth import ADMIN, auth_config
from xdsserver.snapshot import SnapshotCache
from xdsserver.status import ConnectionRegistry


@dataclass
class Harness:
    http: httpx.AsyncClient
    """Sends the admin token unless a request overrides the header."""
    store: Store
    reconciler: Reconciler
    client: EtcdClient
    prefix: str
    app: FastAPI

    async def raw(self, relative_key: str) -> bytes | None:
        """The value at a key, read straight from etcd."""
        kv = await self.client.get(f"{self.prefix}/{relative_key}".encode())
        return kv.value if kv is not None else None


@contextlib.asynccontextmanager
async def running_api(
    etcd_endpoint: str,
    prefix: str,
    *,
    auth: AuthConfig | None = None,
    quiet_period: float = 0.005,
    max_wait: float = 0.05,
    write_limit: WriteRateLimit | None = None,
    cors_origins: tuple[str, ...] = (),
) -> AsyncIterator[Harness]:
    """Store (with its audit log), mirror, reconciler and app over one etcd prefix; stopped on
    exit."""
    client = EtcdClient([etcd_endpoint])
    await client.connect()
    registry = CollectorRegistry()
    audit = AuditLog(client, prefix)
    store = Store(client, prefix, on_write=audit.record)
    reconciler = Reconciler(
        SnapshotCache(),
        quiet_period=quiet_period,
        max_wait=max_wait,
        metrics=ReconcileMetrics(registry),
    )
    mirror: StateMirror

    def on_change(change: StateChange) -> None:
        reconciler.on_change(change, mirror.items)

    mirror = StateMirror(client, prefix, on_change)
    tasks = [asyncio.create_task(mirror.run()), asyncio.create_task(reconciler.run())]
    app = create_app(
        ApiContext(
            store=store,
            reconciler=reconciler,
            connections=ConnectionRegistry(registry=registry),
            auth=auth or auth_config(),
            metrics_registry=registry,
            mirror=mirror,
            audit=audit,
            write_limit=write_limit,
            cors_origins=cors_origins,
        )
    )
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://kvpilot", headers=ADMIN
        ) as http:
            yield Harness(http, store, reconciler, client, prefix, app)
    finally:
        for task in tasks:
            task.cancel()
        # Close the channels before waiting: a mirror cancelled while its watch is being opened
        # was seen to stay pending for many seconds until the gRPC call ended.
        await client.close()
        await asyncio.gather(*tasks, return_exceptions=True)
