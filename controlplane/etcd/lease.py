"""A lease kept alive in the background, granted anew if etcd lost it."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from controlplane.etcd.types import EtcdClosed, EtcdError

log = logging.getLogger(__name__)


class LeaseClient(Protocol):
    """What a LeaseKeeper needs of the etcd client."""

    async def grant_lease(self, ttl: int) -> int: ...

    async def keepalive_once(self, lease_id: int) -> int: ...

    async def revoke_lease(self, lease_id: int) -> None: ...


class LeaseKeeper:
    """Keeps one lease alive in a background task; see ``EtcdClient.keepalive_forever``."""

    def __init__(
        self,
        client: LeaseClient,
        ttl: int,
        *,
        lease_id: int | None = None,
        on_regrant: Callable[[int], Awaitable[None] | None] | None = None,
        revoke_on_exit: bool = True,
    ) -> None:
        if ttl < 1:
            raise ValueError("lease TTL must be at least 1 second")
        self._client = client
        self.ttl = ttl
        self.lease_id = lease_id or 0
        self._on_regrant = on_regrant
        self._revoke_on_exit = revoke_on_exit
        self._task: asyncio.Task[None] | None = None
        self.regrants = 0
        """How many times the lease was lost and granted anew."""
        self.last_error: str | None = None
        """The last failure to refresh the lease, ``None`` after a success."""

    @property
    def running(self) -> bool:
        """Whether the lease is being kept alive: it stops on its own only when the client is
        closed."""
        return self._task is not None and not self._task.done()

    async def __aenter__(self) -> LeaseKeeper:
        if not self.lease_id:
            self.lease_id = await self._client.grant_lease(self.ttl)
        self._task = asyncio.create_task(self._run(), name=f"lease-keepalive-{self.lease_id:x}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._revoke_on_exit and self.lease_id:
            try:
                await self._client.revoke_lease(self.lease_id)
            except EtcdClosed:
                log.info("etcd client closed; lease %x is left to expire", self.lease_id)
            except EtcdError as err:
                log.warning("could not revoke lease %x on exit: %s", self.lease_id, err)

    async def _run(self) -> None:
        interval = max(self.ttl / 3, 0.2)
        wait = interval
        owner_behind = False  # on_regrant has not yet succeeded for the current lease
        while True:
            await asyncio.sleep(wait)
            try:
                remaining = await self._client.keepalive_once(self.lease_id)
                if remaining <= 0:
                    old = self.lease_id
                    self.lease_id = await self._client.grant_lease(self.ttl)
                    self.regrants += 1
                    owner_behind = True
                    log.warning("lease %x was lost; granted %x", old, self.lease_id)
                if owner_behind:
                    # Retried until it succeeds: the owner's keys must land on the new lease.
                    await self._call_on_regrant()
                    owner_behind = False
                self.last_error = None
                wait = interval
            except EtcdClosed:
                log.info("etcd client closed; lease %x is no longer kept alive", self.lease_id)
                return
            except EtcdError as err:
                self.last_error = str(err)
                log.warning("lease %x keepalive failed: %s", self.lease_id, err)
                wait = min(interval, 1.0)

    async def _call_on_regrant(self) -> None:
        if self._on_regrant is None:
            return
        try:
            result = self._on_regrant(self.lease_id)
            if inspect.isawaitable(result):
                await result
        except EtcdError:
            raise
        except Exception:
            # A bug in the callback is not fixed by calling it again.
            log.exception("on_regrant callback failed for lease %x", self.lease_id)
