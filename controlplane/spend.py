"""Spend shared across kvpilot replicas through etcd, and kept across restarts.

Each replica folds the usage entries of its Envoys into a Ledger (``xdsserver.usage``) and
writes the tenants that changed, at most once per ``interval``, to
``{prefix}/status/spend/{replica}/{tenant}`` in one transaction: a batch, never a write per
request. The records carry no lease: a replica that stops leaves its counts behind, so no
spend is lost when it goes; a replica started again under the same ``--replica-id`` reads its
own records back first and continues from them. Readers sum every replica's records (totals,
or the current calendar window of a kind) from their etcd mirror, taking their own replica's
counters from memory, which are newer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, unquote

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from controlplane.etcd import EtcdClosed, EtcdError, KeyValue
from controlplane.keys import STATUS, decode_json, encode_json
from controlplane.signals import PlanResolver
from controlplane.store import Store
from policies import PolicyState, RoutingPlan
from policies.spend import Ledger, Spend, SpendKey, TokenPrice, Window, sum_records
from xdsserver.usage import UsageBook

log = logging.getLogger(__name__)

SPEND_PREFIX = f"{STATUS}/spend/"
"""Relative key prefix of every replica's spend records."""
SPEND_INTERVAL = 0.25
"""Seconds between two batches of spend writes of one replica."""


def spend_key(replica_id: str, tenant: str) -> str:
    # An empty tenant (no tenant header) still needs a key segment.
    return f"{SPEND_PREFIX}{quote(replica_id, safe='')}/{quote(tenant, safe='') or '%00'}"


def replica_of(key: str) -> str:
    return unquote(key[len(SPEND_PREFIX) :].split("/", 1)[0])


def records(
    items: Mapping[str, KeyValue],
    *,
    except_replica: str | None = None,
    tenants: Collection[str] | None = None,
) -> Iterator[Mapping[str, Any]]:
    """Every replica's spend records in the mirror (but ``except_replica``'s; of ``tenants``
    only, told by the key, so other tenants' records are not even decoded)."""
    wanted = None if tenants is None else {quote(t, safe="") or "%00" for t in tenants}
    for key, kv in items.items():
        if not key.startswith(SPEND_PREFIX):
            continue
        replica, _, tenant = key[len(SPEND_PREFIX) :].partition("/")
        if except_replica is not None and unquote(replica) == except_replica:
            continue
        if wanted is not None and tenant not in wanted:
            continue
        body = _decoded(kv)
        if body is not None:
            yield body


@functools.lru_cache(maxsize=8192)
def _parse(value: bytes) -> Mapping[str, Any] | None:
    """A record's JSON, memoized by its bytes: a budget check after every batch reads the
    other replicas' records, which change at most every SPEND_INTERVAL. Read only."""
    return decode_json(value)


def _decoded(kv: KeyValue) -> Mapping[str, Any] | None:
    return _parse(kv.value)


def fleet_spend(
    items: Mapping[str, KeyValue],
    ledger: Ledger,
    replica_id: str,
    window: Window | None,
    at: float,
    tenants: Collection[str] | None = None,
) -> dict[SpendKey, Spend]:
    """Every replica's spend summed: the others' from etcd, this one's from memory once it has
    read its stored records back (from etcd until then, so a restart shows no dip); of
    ``tenants`` only, when given."""
    if not ledger.loaded:
        return sum_records(records(items, tenants=tenants), window, at)
    out = sum_records(records(items, except_replica=replica_id, tenants=tenants), window, at)
    for key, spend in ledger.rows(window, at, tenants):
        out.setdefault(key, Spend()).add(spend)
    return out


class PlanContext:
    """Resolves usage entries against the reconciler's current plan and state."""

    def __init__(
        self,
        plan: Callable[[], RoutingPlan | None],
        state: Callable[[], PolicyState | None],
    ) -> None:
        self._plan = plan
        self._state = state
        self._pools = PlanResolver(plan)
        self._seen: RoutingPlan | None = None
        self._headers: dict[str, str] = {}

    def pool(self, cluster: str, address: str, port: int) -> str | None:
        return self._pools(cluster, address, port)

    def price(self, pool: str) -> TokenPrice | None:
        state = self._state()
        spec = state.pools.get(pool) if state is not None else None
        price = spec.spec.price if spec is not None else None
        if price is None or price.input is None or price.output is None:
            return None
        return TokenPrice(
            currency=price.currency,
            input=price.input,
            cached_input=price.cached_input if price.cached_input is not None else price.input,
            output=price.output,
        )

    def tenant_header(self, route: str) -> str:
        plan = self._plan()
        if plan is not self._seen:
            self._headers = {
                plan_route.name: plan_route.tenant_header
                for fleet in (plan.fleets if plan is not None else ())
                for listener in fleet.listeners
                for vhost in listener.virtual_hosts
                for plan_route in vhost.routes
            }
            self._seen = plan
        return self._headers.get(route, "")


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
        try:
            while True:
                await asyncio.sleep(self.interval)
                try:
                    await self.flush()
                except EtcdClosed:
                    log.info("etcd client closed; spend is no longer published")
                    return
                except EtcdError as error:
                    log.warning("cannot publish spend (will retry): %s", error)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout(2.0):
                    await self.flush()
            except (EtcdError, TimeoutError) as error:
                log.warning(
                    "spend of the last %.2fs not stored at shutdown: %s", self.interval, error
                )
            raise


class SpendCollector(Collector):
    """Prometheus counters of this replica's spend, read from its ledger at scrape time (no
    work per request). Sum over replicas: each exports what its own Envoys logged."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterable[Any]:
        labels = ["tenant", "model", "pool", "class", "route"]
        tokens = CounterMetricFamily(
            "kvpilot_tokens",
            "Tokens of responses through kvpilot's listeners, from OpenAI's usage object; kind "
            "prompt (uncached prompt), cached (prompt tokens from the prefix cache), completion.",
            labels=[*labels, "kind"],
        )
        requests = CounterMetricFamily(
            "kvpilot_usage_requests",
            "Responses that carried a usage object.",
            labels=labels,
        )
        cost = CounterMetricFamily(
            "kvpilot_spend",
            "What those tokens cost at the pool's per-token price, in the price's currency.",
            labels=[*labels, "currency"],
        )
        for key, spend in sorted(self.ledger.totals.items()):
            base = [key.tenant, key.model, key.pool, key.service_class, key.route]
            tokens.add_metric([*base, "prompt"], spend.prompt_tokens - spend.cached_tokens)
            tokens.add_metric([*base, "cached"], spend.cached_tokens)
            tokens.add_metric([*base, "completion"], spend.completion_tokens)
            requests.add_metric(base, spend.requests)
            if key.currency:
                cost.add_metric([*base, key.currency], float(spend.cost))
        yield tokens
        yield requests
        yield cost
