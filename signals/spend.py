"""Spend: token counts and their price, by tenant, model, pool, service class and route, in
calendar windows (UTC). Pure: ``xdsserver.usage`` feeds a Ledger from Envoy's access logs,
``controlplane.spend`` stores each replica's ledger in etcd and sums every replica's.

Money is ``Decimal``: a price per million tokens times an integer count is exact, and so is
every sum a finance owner adds up again (floats drift after a few million additions). It is
stored as a decimal string and exported to Prometheus as a float.
"""

from __future__ import annotations

import calendar
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal

from policies.models.price import Price

Window = Literal["minute", "hour", "day", "month"]
WINDOWS: tuple[Window, ...] = ("minute", "hour", "day", "month")
TOKEN_KINDS = ("prompt", "cached", "completion")
"""Prometheus' ``kind`` label. ``prompt`` counts the uncached prompt tokens, so the three add
up to the request's total; OpenAI's ``prompt_tokens`` is prompt + cached."""
MILLION = Decimal(1_000_000)


@dataclass(frozen=True, order=True, slots=True)
class SpendKey:
    """What spend is counted by. Empty strings: not known (no tenant header, say)."""

    tenant: str
    model: str
    pool: str
    service_class: str
    route: str
    currency: str = ""
    """The currency of the pool's price; empty for a pool without per-token prices."""
    virtual_model: str = ""
    """The virtual model (``policy/name``) the client called, when Envoy chose ``model`` for
    it; empty for a request that named its model itself."""

    def as_list(self) -> list[str]:
        """The key's fields as stored, but the virtual model (``_rows`` puts it last)."""
        return [
            self.tenant,
            self.model,
            self.pool,
            self.service_class,
            self.route,
            self.currency,
        ]


@dataclass(slots=True)
class Spend:
    """Counters of one key: requests, tokens (OpenAI's usage) and their cost."""

    requests: int = 0
    prompt_tokens: int = 0
    """OpenAI's ``prompt_tokens``: cached ones included."""
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost: Decimal = field(default_factory=Decimal)

    @property
    def tokens(self) -> int:
        """Prompt plus completion tokens: what a token budget counts."""
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: Spend) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.cost += other.cost

    def as_list(self) -> list[Any]:
        return [
            self.requests,
            self.prompt_tokens,
            self.cached_tokens,
            self.completion_tokens,
            str(self.cost),
        ]

    @classmethod
    def from_list(cls, row: list[Any]) -> Spend:
        requests, prompt, cached, completion, cost = row
        return cls(int(requests), int(prompt), int(cached), int(completion), Decimal(cost))

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "promptTokens": self.prompt_tokens,
            "cachedTokens": self.cached_tokens,
            "completionTokens": self.completion_tokens,
            "tokens": self.tokens,
            "cost": str(self.cost),
        }


@dataclass(frozen=True, slots=True)
class TokenPrice:
    """Per-token prices of a pool, per million tokens, in ``currency``."""

    currency: str
    input: Decimal
    cached_input: Decimal
    output: Decimal

    def cost(self, prompt: int, cached: int, completion: int) -> Decimal:
        """The exact price of one response's usage: uncached prompt tokens at the input price,
        cached ones at the cached-input price, completion tokens at the output price."""
        cached = min(cached, prompt)
        return (
            (prompt - cached) * self.input + cached * self.cached_input + completion * self.output
        ) / MILLION


def token_price(price: Price | None) -> TokenPrice | None:
    """A pool's per-token price (None: priced per replica-hour, or not at all)."""
    if price is None or price.input is None or price.output is None:
        return None
    return TokenPrice(
        currency=price.currency,
        input=price.input,
        cached_input=price.cached_input if price.cached_input is not None else price.input,
        output=price.output,
    )


def window_bounds(window: Window, at: float) -> tuple[datetime, datetime]:
    """The calendar window (UTC) that holds ``at``: its start and its end (the next start)."""
    now = datetime.fromtimestamp(at, UTC)
    if window == "minute":
        start = now.replace(second=0, microsecond=0)
        return start, datetime.fromtimestamp(start.timestamp() + 60, UTC)
    if window == "hour":
        start = now.replace(minute=0, second=0, microsecond=0)
        return start, datetime.fromtimestamp(start.timestamp() + 3600, UTC)
    if window == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, datetime.fromtimestamp(start.timestamp() + 86400, UTC)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    days = calendar.monthrange(start.year, start.month)[1]
    return start, datetime.fromtimestamp(start.timestamp() + days * 86400, UTC)


def window_id(window: Window, at: float) -> str:
    """The window's start, ISO 8601 in UTC: the same string on every replica."""
    return window_bounds(window, at)[0].strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class WindowSpend:
    """Counters of the current calendar window of one kind, by tenant."""

    id: str = ""
    rows: dict[str, dict[SpendKey, Spend]] = field(default_factory=dict)


def _add(into: dict[str, dict[SpendKey, Spend]], key: SpendKey, spend: Spend) -> None:
    into.setdefault(key.tenant, {}).setdefault(key, Spend()).add(spend)


def _rows(rows: Mapping[SpendKey, Spend]) -> list[list[Any]]:
    # The virtual model goes after the counters, and only when there is one: a replica of an
    # older version reads the first eleven fields of a row and ignores the rest, so replicas
    # of both versions sum each other's records during a rolling upgrade.
    return [
        key.as_list() + spend.as_list() + ([key.virtual_model] if key.virtual_model else [])
        for key, spend in rows.items()
    ]


class Ledger:
    """One replica's spend since it was first started: totals and the current window of each
    kind, by tenant, so that a batch writes only the tenants that changed and a reader sums
    only the tenants it needs."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, dict[SpendKey, Spend]] = {}
        """Totals: tenant -> key -> counters."""
        self.windows: dict[Window, WindowSpend] = {window: WindowSpend() for window in WINDOWS}
        self.changed: set[str] = set()
        """Tenants whose counters changed since ``take_changed``."""
        self.loaded = False
        """True once the replica's stored records were read back (``load``)."""

    @property
    def totals(self) -> dict[SpendKey, Spend]:
        """Every key's totals (a new mapping of the same counters)."""
        return {key: spend for rows in self.by_tenant.values() for key, spend in rows.items()}

    def add(self, key: SpendKey, spend: Spend, at: float) -> None:
        """Count one response (or a batch of them) at wall-clock time ``at``."""
        _add(self.by_tenant, key, spend)
        for window, current in self.windows.items():
            wid = window_id(window, at)
            if current.id != wid:
                current.id, current.rows = wid, {}
            _add(current.rows, key, spend)
        self.changed.add(key.tenant)

    def take_changed(self) -> set[str]:
        changed, self.changed = self.changed, set()
        return changed

    def tenants(self) -> set[str]:
        return set(self.by_tenant)

    def rows(
        self, window: Window | None, at: float, tenants: Collection[str] | None = None
    ) -> Iterable[tuple[SpendKey, Spend]]:
        """This ledger's counters: totals, or the window of a kind that holds ``at`` (none
        when the ledger's window of that kind is an older one); of ``tenants`` only."""
        if window is None:
            source = self.by_tenant
        else:
            current = self.windows[window]
            source = current.rows if current.id == window_id(window, at) else {}
        for tenant, rows in source.items():
            if tenants is None or tenant in tenants:
                yield from rows.items()

    def record(self, tenant: str) -> dict[str, Any]:
        """The JSON stored for one tenant (``load`` reads it back)."""
        return {
            "tenant": tenant,
            "totals": _rows(self.by_tenant.get(tenant, {})),
            "windows": {
                window: {"id": current.id, "rows": _rows(current.rows.get(tenant, {}))}
                for window, current in self.windows.items()
            },
        }

    def load(self, record: Mapping[str, Any]) -> None:
        """Continue from a stored record of this replica (after a restart)."""
        for key, spend in parse_rows(record.get("totals")):
            _add(self.by_tenant, key, spend)
        windows = record.get("windows")
        for window in WINDOWS:
            stored = windows.get(window) if isinstance(windows, dict) else None
            if not isinstance(stored, dict) or not isinstance(stored.get("id"), str):
                continue
            current = self.windows[window]
            # Each tenant's record holds the window it was last written in, so the records
            # of one replica can name different windows (a tenant that stopped before the
            # minute turned): the newest is the current one, whichever record comes first.
            # Ids of one kind compare as times (``window_id``: fixed-width ISO 8601).
            if stored["id"] < current.id:
                continue
            if stored["id"] > current.id:
                current.id, current.rows = stored["id"], {}
            for key, spend in parse_rows(stored.get("rows")):
                _add(current.rows, key, spend)


def parse_rows(rows: Any) -> Iterable[tuple[SpendKey, Spend]]:
    """Rows of a stored record: six key fields, five counters, and the virtual model when
    there is one; rows that do not parse are skipped (nothing kvpilot wrote)."""
    if not isinstance(rows, list):
        return
    for row in rows:
        try:
            tenant, model, pool, service_class, route, currency = (str(p) for p in row[:6])
            virtual = str(row[11]) if len(row) > 11 else ""
            key = SpendKey(tenant, model, pool, service_class, route, currency, virtual)
            yield key, Spend.from_list(row[6:11])
        except (TypeError, ValueError, ArithmeticError):
            continue


def sum_records(
    records: Iterable[Mapping[str, Any]],
    window: Window | None,
    at: float,
    into: dict[SpendKey, Spend] | None = None,
) -> dict[SpendKey, Spend]:
    """Every replica's records summed (into ``into`` when given): totals (``window`` None),
    or the current calendar window of a kind (records of an older window count nothing)."""
    out: dict[SpendKey, Spend] = {} if into is None else into
    wid = window_id(window, at) if window is not None else ""
    for record in records:
        if window is None:
            rows = record.get("totals")
        else:
            windows = record.get("windows")
            stored = windows.get(window) if isinstance(windows, dict) else None
            if not isinstance(stored, dict) or stored.get("id") != wid:
                continue
            rows = stored.get("rows")
        for key, spend in parse_rows(rows):
            out.setdefault(key, Spend()).add(spend)
    return out


def group(rows: Mapping[SpendKey, Spend], by: Iterable[str]) -> dict[tuple[str, ...], Spend]:
    """Rows summed by some of the key's fields (``tenant``, ``model``, ``pool``, ...)."""
    fields = tuple(by)
    out: dict[tuple[str, ...], Spend] = {}
    for key, spend in rows.items():
        out.setdefault(tuple(getattr(key, name) for name in fields), Spend()).add(spend)
    return out
