"""What each replica serves, as compilation sees it: a pool's own ``models`` where it lists
them (static lists win), else the models and LoRA adapters its replicas' agents report in
their telemetry records (``signals.discovery``). Pure.

A record keeps the last list its agent could read (with ``models_error`` while the list
cannot be read), and records live under the agent's lease: a replica whose agent died has
no record and serves nothing known, one whose list broke keeps what it last served.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from policies.models import Pool
from signals.state import PolicyState, is_external


@dataclass(frozen=True, slots=True)
class PoolModels:
    """What one pool's replicas serve."""

    static: bool
    """The pool lists its models: every replica serves exactly those."""
    by_endpoint: Mapping[str, tuple[str, ...]]
    """Endpoint key -> models and adapters it serves, sorted (reported ones only, for a pool
    without a list; an endpoint without a report is left out)."""
    models: tuple[str, ...]
    """Base models of the pool, sorted."""
    adapters: tuple[str, ...]
    """Adapters loaded on some replica, sorted."""
    parents: tuple[tuple[str, str], ...] = ()
    """(adapter, the base model of a replica that has it loaded), sorted."""

    @property
    def served(self) -> tuple[str, ...]:
        """Models and adapters, sorted: what a client may ask this pool for."""
        return tuple(sorted({*self.models, *self.adapters}))


NO_MODELS = PoolModels(static=False, by_endpoint={}, models=(), adapters=())


def pool_models(pool: Pool, state: PolicyState) -> PoolModels:
    """What ``pool`` serves: its own list, or what its replicas report."""
    if pool.spec.models:
        listed = tuple(sorted(set(pool.spec.models)))
        return PoolModels(static=True, by_endpoint={}, models=listed, adapters=())
    records = state.telemetry.get(pool.metadata.name)
    if not records or is_external(pool):
        return NO_MODELS
    by_endpoint: dict[str, tuple[str, ...]] = {}
    models: set[str] = set()
    adapters: set[str] = set()
    parents: dict[str, str] = {}
    for key in sorted(records):
        record = records[key]
        if record.models is None and record.adapters is None:
            continue
        models.update(record.models or ())
        adapters.update(record.adapters or ())
        by_endpoint[key] = tuple(sorted({*(record.models or ()), *(record.adapters or ())}))
        if record.models:
            for adapter in record.adapters or ():
                parents.setdefault(adapter, record.models[0])
    if not by_endpoint:
        return NO_MODELS
    # A name that one replica serves as its base model and another as an adapter is listed
    # once, as a model.
    return PoolModels(
        static=False,
        by_endpoint=by_endpoint,
        models=tuple(sorted(models)),
        adapters=tuple(sorted(adapters - models)),
        parents=tuple(sorted((a, p) for a, p in parents.items() if a not in models)),
    )


def served_models(state: PolicyState) -> dict[str, PoolModels]:
    """``pool_models`` of every pool that serves something known."""
    out = {}
    for name, pool in state.pools.items():
        served = pool_models(pool, state)
        if served is not NO_MODELS:
            out[name] = served
    return out
