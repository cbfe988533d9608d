"""The telemetry agent: scrape model servers' metrics into etcd, under a lease (its command
line, `kvpilot agent`, is ``commands.agent``).

Runs beside one model server, or centrally for many. Every ``--interval`` it scrapes each
backend's Prometheus endpoint, reads it through a metric map (vLLM, SGLang, TGI or a
user-defined one, see ``signals.telemetry``) and writes a compact ``TelemetryRecord`` to
``{prefix}/telemetry/{pool}/{address:port}``. With ``--register`` it also registers each
backend as an endpoint of its pool under ``{prefix}/endpoints/{pool}/{address:port}``.

Everything is written under one lease that the agent keeps alive. When the agent dies, the
lease expires after ``--ttl`` seconds and its telemetry and registrations disappear with it: a
dead agent neither steers traffic with old numbers nor keeps a dead backend in rotation. When
a backend stops answering while the agent lives, its telemetry is no longer refreshed (so it
goes stale and neutral in ``--max-age`` time) and after ``--unregister-after`` failed scrapes
its registration is withdrawn; it is registered again when it answers.

Registrations carry the backend's region, zone and capacity kind. With
``--preemption-notice`` the agent watches for its machine's preemption (``notice``): once a
notice is out it registers every backend as draining, and Envoy stops sending it new work.

Cheap by design: one HTTP client for all backends, a cap on the size of a scrape, a scrape
timeout shorter than the interval, and a record is written only when it moved beyond its
band (``signals.writeband.WriteBand``) from the one last written, or every ``--refresh``
seconds to keep it fresh: at 10,000 endpoints that keeps etcd well under 2,000 writes a second
(``python -m bench controlplane``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from controlplane.agent.notice import NoticeSource
from controlplane.etcd import (
    EtcdClosed,
    EtcdError,
    EtcdSecurity,
    LeaseKeeper,
)
from controlplane.etcd.keys import DEFAULT_PREFIX
from controlplane.etcd.store import Store
from signals.discovery import (
    MODELS_PATHS,
    Discovered,
    DiscoveryError,
    lora_adapters,
    parse_models,
)
from signals.telemetry import (
    Counters,
    MetricMap,
    TelemetryRecord,
    extract,
    metric_map_for,
    parse_samples,
)
from signals.writeband import WriteBand

log = logging.getLogger("kvpilot.agent")

CONFIRM_WRITES = 2
"""Records an agent writes after one that moved a replica's speed, whatever they hold. The
capacity weights act on two slow records in a row, and the first record after a slowdown
often still holds time from before it (or a median that has not moved yet): with only one
record after it, the second slow record would wait for the next ``refresh``."""

MAX_SCRAPE_BYTES = 8 * 1024 * 1024
"""A /metrics answer larger than this is refused rather than held in memory."""


@dataclass
class Target:
    """One backend the agent scrapes (and maybe registers)."""

    pool: str
    url: str
    """Base URL of the model server, for example ``http://10.0.0.5:8000``."""
    address: str = ""
    """Address registered in EDS (an IP); default: the URL's host."""
    port: int = 0
    """Port registered in EDS; default: the URL's port."""
    weight: int = 100
    name: str = ""
    """Stable name registered with the endpoint (its place on the hash ring); default none."""
    metrics_path: str = "/metrics"
    models_path: str | None = None
    """Where the server lists its models and adapters; None: the format's own
    (``signals.discovery.MODELS_PATHS``); empty: not read."""
    max_running: float | None = None
    """Batch capacity when the server does not export it (vLLM ``--max-num-seqs``)."""
    region: str = ""
    """Region registered with the endpoint; default none."""
    zone: str = ""
    """Zone within the region; default none."""
    capacity: str = ""
    """``on-demand``, ``spot`` or ``reserved``; default unknown."""

    # Scrape state.
    counters: Counters | None = field(default=None, repr=False)
    last_written: TelemetryRecord | None = field(default=None, repr=False)
    failures: int = field(default=0, repr=False)
    registered: bool = field(default=False, repr=False)
    confirm: int = field(default=0, repr=False)
    """Records still to write whatever they hold, after one that moved the replica's speed
    (`CONFIRM_WRITES`)."""
    served: Discovered | None = field(default=None, repr=False)
    """The last model list read: kept, and written, while the list cannot be read."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend URL {self.url!r} must look like http://host:port")
        self.address = self.address or parts.hostname
        self.port = self.port or parts.port or (443 if parts.scheme == "https" else 80)
        self.url = self.url.rstrip("/")

    @property
    def endpoint_id(self) -> str:
        """The endpoint's id in etcd: ``address:port``, the same as ``Endpoint.key``."""
        return f"{self.address}:{self.port}"

    def endpoint_body(self, *, draining: bool = False) -> dict[str, Any]:
        """The registration; ``draining`` once a preemption notice is out."""
        body: dict[str, Any] = {"address": self.address, "port": self.port, "weight": self.weight}
        if self.name:
            body["name"] = self.name
        if self.region or self.zone:
            body["locality"] = {"region": self.region, "zone": self.zone}
        if self.capacity:
            body["capacity"] = self.capacity
        if draining:
            body["health"] = "draining"
        return body


@dataclass
class AgentConfig:
    """Everything the agent needs (`kvpilot agent` builds it from its flags; per-backend
    settings live on each `Target`)."""

    etcd_endpoints: list[str]
    targets: list[Target]
    prefix: str = DEFAULT_PREFIX
    format: str = "vllm"
    metric_map: MetricMap | None = None
    interval: float = 1.0
    ttl: int = 10
    refresh: float = 6.0
    band: WriteBand = field(default_factory=WriteBand)
    """What counts as a change worth writing before the next refresh."""
    register: bool = False
    unregister_after: int = 3
    etcd_security: EtcdSecurity = field(default_factory=EtcdSecurity)
    """TLS files and user for etcd; an agent's user needs read-write on its pools' keys only."""
    notices: list[NoticeSource] = field(default_factory=list)
    """Where a preemption notice appears; once one does, every backend is drained."""
    notice_interval: float = 1.0
    """Seconds between two looks at the notice sources."""


class Agent:
    """The scrape-and-write loop. ``run()`` until cancelled or until its etcd client is closed;
    the lease is revoked on a clean exit, and simply expires when the process is killed (or
    the client was closed first)."""

    def __init__(
        self, store: Store, config: AgentConfig, *, http: httpx.AsyncClient | None = None
    ) -> None:
        self.store = store
        self.config = config
        self.metric_map = metric_map_for(config.format, config.metric_map)
        self._http = http
        self._lease: LeaseKeeper | None = None
        self.scrapes = 0
        """Completed scrape rounds (for tests and logs)."""
        self.notice: str | None = None
        """The preemption notice, once one is out: the backends are draining from then on."""
        self._drained = False

    @property
    def lease_id(self) -> int:
        return self._lease.lease_id if self._lease is not None else 0

    async def run(self) -> None:
        timeout = httpx.Timeout(max(0.2, min(self.config.interval * 0.8, 5.0)))
        async with contextlib.AsyncExitStack() as stack:
            http = self._http
            if http is None:
                http = await stack.enter_async_context(
                    httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64))
                )
            self._lease = await stack.enter_async_context(
                self.store.keep_lease(self.config.ttl, on_regrant=self._rewrite)
            )
            log.info(
                "agent: %d backend(s), lease %x (ttl %ds), every %gs",
                len(self.config.targets),
                self.lease_id,
                self.config.ttl,
                self.config.interval,
            )
            loop = asyncio.get_running_loop()
            if self.config.notices:
                watch = asyncio.create_task(self._watch_notices(http), name="notices")
                stack.callback(watch.cancel)
            try:
                while True:
                    started = loop.time()
                    records = await asyncio.gather(
                        *(self._tick(http, t) for t in self.config.targets)
                    )
                    await self._write(
                        [(t, r) for t, r in zip(self.config.targets, records, strict=True) if r]
                    )
                    self.scrapes += 1
                    await asyncio.sleep(max(0.0, self.config.interval - (loop.time() - started)))
            except EtcdClosed:
                log.info("etcd client closed; the agent stops after %d scrapes", self.scrapes)

    async def _tick(self, http: httpx.AsyncClient, target: Target) -> TelemetryRecord | None:
        """Scrape one backend (registering it first when asked); the record to write, or None
        when it failed or stayed within its band since the last write."""
        models_path = (
            target.models_path
            if target.models_path is not None
            else MODELS_PATHS.get(self.config.format, "")
        )
        listing = (
            asyncio.ensure_future(self._models(http, target.url + models_path))
            if models_path
            else None
        )
        try:
            text = await _scrape(http, target.url + target.metrics_path)
            samples = parse_samples(text)
        except (httpx.HTTPError, ValueError) as error:
            target.failures += 1
            if target.failures == 1:
                log.warning("scrape of %s failed: %s", target.url, error)
            if target.registered and target.failures >= self.config.unregister_after:
                await self._withdraw(target)
            if listing is not None:
                listing.cancel()
            return None
        if target.failures:
            log.info("scrape of %s works again after %d failure(s)", target.url, target.failures)
        target.failures = 0
        record, target.counters = extract(
            samples,
            self.metric_map,
            at=time.time(),
            previous=target.counters,
            format=self.config.format,
            max_running=target.max_running,
        )
        if listing is not None:
            record = self._served(target, record, await listing, lora_adapters(text))
        try:
            if self.config.register and not target.registered:
                await self.store.put_endpoint(
                    target.pool,
                    target.endpoint_id,
                    target.endpoint_body(draining=self.notice is not None),
                    lease=self.lease_id,
                )
                target.registered = True
                log.info("registered %s in pool %s", target.endpoint_id, target.pool)
        except EtcdClosed:
            raise
        except EtcdError as error:
            # The lease keeper re-grants a lost lease and calls _rewrite; until then, retry
            # on the next tick.
            log.warning("registering %s in etcd failed: %s", target.endpoint_id, error)
            target.registered = False
            return None
        last = target.last_written
        if (
            last is None
            or target.confirm
            or self.config.band.moved(last, record)
            or record.at - last.at >= self.config.refresh
        ):
            return record
        return None

    async def _models(self, http: httpx.AsyncClient, url: str) -> Discovered | str:
        """The server's model list, or why it could not be read."""
        try:
            return parse_models(self.config.format, json.loads(await _scrape(http, url)))
        except (httpx.HTTPError, ValueError) as error:
            # DiscoveryError and json's errors are ValueErrors.
            kind = "" if isinstance(error, DiscoveryError) else f"{type(error).__name__}: "
            return f"GET {url}: {kind}{error}"[:500]

    def _served(
        self,
        target: Target,
        record: TelemetryRecord,
        listing: Discovered | str,
        in_use: tuple[str, ...] | None,
    ) -> TelemetryRecord:
        """The record with what the server serves: the list just read, or the last one read
        and the reason this one failed (a server whose list cannot be read keeps its last
        known models rather than dropping out of model routing)."""
        error: str | None = None
        if isinstance(listing, str):
            error = listing
            last = target.last_written
            if error != (last.models_error if last is not None else None):
                log.warning("model list of %s: %s", target.url, error)
        else:
            target.served = listing
        served = target.served
        if served is None:
            return record.model_copy(update={"models_error": error})
        # Adapters with requests running or waiting are loaded even when the model list
        # was read just before they were.
        adapters = tuple(sorted(set(served.adapters) | set(in_use or ())))
        return record.model_copy(
            update={"models": served.models, "adapters": adapters, "models_error": error}
        )

    async def _write(self, writes: list[tuple[Target, TelemetryRecord]]) -> None:
        """This round's records, batched into as few etcd transactions as they fit in."""
        if not writes:
            return
        try:
            await self.store.put_telemetry_many(
                [(t.pool, t.endpoint_id, json.loads(r.to_json())) for t, r in writes],
                lease=self.lease_id,
            )
        except EtcdClosed:
            raise
        except EtcdError as error:
            log.warning("writing telemetry of %d backend(s) failed: %s", len(writes), error)
            for target, _ in writes:
                # Written again in full on the next tick.
                target.last_written = None
            return
        for target, record in writes:
            last = target.last_written
            if last is not None and self.config.band.speed_moved(last, record):
                target.confirm = CONFIRM_WRITES
            else:
                target.confirm = max(0, target.confirm - 1)
            target.last_written = record

    async def _withdraw(self, target: Target) -> None:
        """A backend that keeps failing leaves its pool until it answers again."""
        try:
            await self.store.delete_endpoint(target.pool, target.endpoint_id)
            await self.store.delete_telemetry(target.pool, target.endpoint_id)
        except EtcdClosed:
            raise
        except EtcdError as error:
            log.warning("withdrawing %s failed: %s", target.endpoint_id, error)
            return
        target.registered = False
        target.last_written = None
        log.warning(
            "withdrew %s from pool %s after %d failed scrapes",
            target.endpoint_id,
            target.pool,
            target.failures,
        )

    async def _rewrite(self, lease_id: int) -> None:
        """The lease was lost (etcd was unreachable for longer than the TTL): put everything
        back under the new one."""
        for target in self.config.targets:
            if target.registered:
                await self.store.put_endpoint(
                    target.pool,
                    target.endpoint_id,
                    target.endpoint_body(draining=self.notice is not None),
                    lease=lease_id,
                )
            if target.last_written is not None:
                await self.store.put_telemetry(
                    target.pool,
                    target.endpoint_id,
                    json.loads(target.last_written.to_json()),
                    lease=lease_id,
                )

    async def _watch_notices(self, http: httpx.AsyncClient) -> None:
        """Look at the notice sources every ``notice_interval`` until one has a notice, then
        drain every registered backend (retried until etcd takes it)."""
        while self.notice is None:
            for source in self.config.notices:
                said = await source.noticed(http)
                if said is not None:
                    self.notice = said
                    log.warning(
                        "preemption notice from %s: %s; draining %d backend(s)",
                        source.describe(),
                        said,
                        len(self.config.targets),
                    )
                    break
            else:
                await asyncio.sleep(self.config.notice_interval)
        while not self._drained:
            try:
                for target in self.config.targets:
                    if target.registered:
                        await self.store.put_endpoint(
                            target.pool,
                            target.endpoint_id,
                            target.endpoint_body(draining=True),
                            lease=self.lease_id,
                        )
                self._drained = True
            except EtcdClosed:
                return
            except EtcdError as error:
                log.warning("draining in etcd failed, retrying: %s", error)
                await asyncio.sleep(self.config.notice_interval)


async def _scrape(http: httpx.AsyncClient, url: str) -> str:
    async with http.stream("GET", url) as response:
        response.raise_for_status()
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > MAX_SCRAPE_BYTES:
                raise ValueError(f"{url} answered more than {MAX_SCRAPE_BYTES} bytes")
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")
