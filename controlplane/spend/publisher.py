"""This replica's ledger written to etcd in batches (one transaction per interval), and read
back at start so a restart continues from the stored totals."""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import quote

from controlplane.etcd import EtcdClosed, EtcdError
from controlplane.etcd.batches import flush_every
from controlplane.etcd.keys import decode_json, encode_json
from controlplane.etcd.store import Store
from controlplane.spend.records import SPEND_INTERVAL, SPEND_PREFIX, spend_key
from xdsserver.usage import UsageBook

log = logging.getLogger(__name__)


class SpendPublisher:
    """Writes a ledger's changed tenants to etcd in batches; reads this replica's records
    back first, so a restart continues from the persisted totals."""

    def __init__(
        self,
        store: Store,
        book: UsageBook,
        replica_id: str,
        *,
        interval: float = SPEND_INTERVAL,
    ) -> None:
        self.store = store
        self.book = book
        self.replica_id = replica_id
        self.interval = interval
        self.writes = 0
        """etcd transactions written (one per batch)."""

    async def load(self) -> None:
        """Continue from this replica's records in etcd (none for a new replica id)."""
        prefix = self.store.keys.absolute(f"{SPEND_PREFIX}{quote(self.replica_id, safe='')}/")
        kvs, _ = await self.store.client.get_prefix(prefix)
        for kv in kvs:
            body = decode_json(kv)
            if isinstance(body, dict):
                self.book.ledger.load(body)
        if kvs:
            log.info("spend: continuing from %d stored tenant records", len(kvs))
        self.book.ledger.loaded = True

    async def flush(self) -> None:
        """Write every tenant that changed since the last batch, in one transaction."""
        changed = self.book.ledger.take_changed()
        if not changed:
            return
        try:
            await self.store.client.put_many(
                [
                    (
                        self.store.keys.absolute(spend_key(self.replica_id, tenant)),
                        encode_json(
                            {"replica": self.replica_id, "at": time.time()}
                            | self.book.ledger.record(tenant)
                        ),
                    )
                    for tenant in sorted(changed)
                ]
            )
            self.writes += 1
        except BaseException:
            self.book.ledger.changed.update(changed)
            raise

    async def run(self) -> None:
        """Load, then publish until cancelled; a cancelled publisher writes its last batch."""
        while not self.book.ledger.loaded:
            try:
                await self.load()
            except EtcdClosed:
                return
            except EtcdError as error:
                log.warning("cannot read this replica's spend records (will retry): %s", error)
                await asyncio.sleep(1.0)
        await flush_every(self.interval, self.flush, "spend")
