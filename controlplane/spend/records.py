"""Spend records in etcd: one per replica and tenant under ``{prefix}/status/spend/``, and the
fleet's spend summed from them (the other replicas' records, this replica's ledger)."""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator, Mapping
from typing import Any
from urllib.parse import quote, unquote

from controlplane.etcd import KeyValue
from controlplane.etcd.keys import STATUS, decode_json
from signals.spend import Ledger, Spend, SpendKey, Window, sum_records

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
