"""A route's prefill fit as etcd keeps it (pure, no I/O): what a kvpilot started again, or
another kvpilot replica, continues from instead of learning it again.

The fit (``signals.prefillfit``) lives in the reconciler's memory and needs a minute of busy
owned replicas to say its weight; until then overflow counts a prefilled token at
``PREFILL_WEIGHT``, which at a batch of 32 reads the owned capacity high (the paid pools get
less than the excess). Each kvpilot replica writes its routes' fits that can say to etcd
(``controlplane.prefillfits``); a fresh fit starts from the stored one when it was learned on
the same owned pools at the same batch size (``FitScope``) within ``STORED_MAX_AGE``, and goes
on learning from it. Its weight's source reads ``stored`` until this replica adds an
interval of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from signals.prefillfit import PrefillFit

SUMS = ("oo", "op", "pp", "ou", "pu", "uu", "to", "tp", "tu", "tt")
"""The fit's decayed sums, as a stored record names them."""
STORED_MAX_AGE = 7 * 86400.0
"""Seconds after which a stored fit is no longer taken (and is deleted): a fit is taken only
for the same pools at the same batch size, and an engine changed since is caught by the
screen within ``RESTART_AFTER`` intervals, so a fit a few days old (a restart after a
weekend) still serves."""


class FitScope(NamedTuple):
    """What a route's fit was learned on: its owned pools and their mean batch size. A
    stored fit is taken only by a route of the same scope."""

    pools: tuple[str, ...]
    batch: float


class StoredFit(NamedTuple):
    """A fit as etcd holds it: learned on `scope`, written at `at` (wall clock) by
    `replica`."""

    fit: PrefillFit
    scope: FitScope
    at: float
    replica: str


def fit_scope(pools: Sequence[str], batches: Sequence[float]) -> FitScope | None:
    """The scope of a fit over replicas of `pools` with these batch sizes (None without
    replicas): their mean batch rounded to a tenth, so a scope does not move with a
    replica's record."""
    if not batches:
        return None
    return FitScope(tuple(sorted(set(pools))), round(sum(batches) / len(batches), 1))


def fit_record(fit: PrefillFit, scope: FitScope, at: float, replica: str) -> dict[str, object]:
    """The JSON body that stores `fit` (``restore`` reads it back)."""
    return {
        "replica": replica,
        "at": at,
        "pools": list(scope.pools),
        "batch": scope.batch,
        "intervals": fit.intervals,
        "windows": fit.windows,
        "screened": fit.screened,
        "in_row": fit.in_row,
        **{name: getattr(fit, name) for name in SUMS},
    }


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def restore(body: Mapping[str, object]) -> StoredFit | None:
    """The stored fit of a record ``fit_record`` wrote, or None for one that does not parse
    (a field missing or not a finite number, a count or a sum of squares below zero, no
    pools)."""
    numbers = {name: _number(body.get(name)) for name in ("at", "batch", "windows", *SUMS)}
    intervals, screened = _count(body.get("intervals")), _count(body.get("screened"))
    in_row = _count(body.get("in_row"))
    pools, replica = body.get("pools"), body.get("replica")
    values = {name: value for name, value in numbers.items() if value is not None}
    if (
        len(values) < len(numbers)
        or intervals is None
        or screened is None
        or in_row is None
        or not isinstance(pools, list)
        or not pools
        or not all(isinstance(pool, str) and pool for pool in pools)
        or not isinstance(replica, str)
        or min(values[name] for name in ("windows", "oo", "pp", "uu", "tt")) < 0
    ):
        return None
    fit = PrefillFit(
        intervals=intervals,
        windows=values["windows"],
        screened=screened,
        in_row=in_row,
        stored=True,
        oo=values["oo"],
        op=values["op"],
        pp=values["pp"],
        ou=values["ou"],
        pu=values["pu"],
        uu=values["uu"],
        to=values["to"],
        tp=values["tp"],
        tu=values["tu"],
        tt=values["tt"],
    )
    scope = FitScope(tuple(sorted(set(pools))), values["batch"])
    return StoredFit(fit, scope, values["at"], replica)


def seeded(
    fit: PrefillFit, stored: StoredFit | None, scope: FitScope | None, now: float
) -> PrefillFit:
    """The fit a route continues from: its own, unless it is fresh (this kvpilot started, or
    the route is new, and no busy interval came yet) and a fit stored for the same scope
    within ``STORED_MAX_AGE`` can say its weight: then that one. A fit that started again
    (``screened``) is never replaced: the engines changed since whatever was stored."""
    if (
        fit != PrefillFit()
        or stored is None
        or scope is None
        or stored.scope != scope
        or now - stored.at > STORED_MAX_AGE
        or stored.fit.weight() is None
    ):
        return fit
    return stored.fit


__all__ = [
    "STORED_MAX_AGE",
    "SUMS",
    "FitScope",
    "StoredFit",
    "fit_record",
    "fit_scope",
    "restore",
    "seeded",
]
