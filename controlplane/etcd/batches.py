"""Records a replica writes to etcd in batches, on a timer, and once more when it stops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from controlplane.etcd.types import EtcdClosed, EtcdError

log = logging.getLogger(__name__)

LAST_BATCH_SECONDS = 2.0
"""Most seconds the batch written on the way out may take."""


async def flush_every(interval: float, flush: Callable[[], Awaitable[None]], what: str) -> None:
    """Call `flush` every `interval` seconds until cancelled, logging (and retrying at the
    next) a batch etcd refused, and stopping once the client is closed; when cancelled,
    flush once more, within ``LAST_BATCH_SECONDS``, then re-raise. `what` names the
    records in the logs ("spend")."""
    try:
        while True:
            await asyncio.sleep(interval)
            try:
                await flush()
            except EtcdClosed:
                log.info("etcd client closed; %s is no longer stored", what)
                return
            except EtcdError as error:
                log.warning("cannot store %s (will retry): %s", what, error)
    except asyncio.CancelledError:
        try:
            async with asyncio.timeout(LAST_BATCH_SECONDS):
                await flush()
        except (EtcdError, TimeoutError) as error:
            log.warning("%s of the last %.2fs not stored at shutdown: %s", what, interval, error)
        raise


__all__ = ["LAST_BATCH_SECONDS", "flush_every"]
