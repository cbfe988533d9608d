"""The operator's console: the read views it needs, and the page itself at ``/ui``.

The page is plain HTML, CSS and JavaScript modules shipped in this package (``api/ui/``): no
build step, nothing fetched from elsewhere at run time. It signs in with the REST API's own
tokens and polls the read views below; every action it offers (set a weight, drain an
endpoint) is an ordinary REST write, so a read token sees everything and changes nothing.

Views:

- ``GET /v1/endpoints``: every pool's endpoints with the weight and health kvpilot sends to
  Envoy, the telemetry behind them and why (saturated, stale, drained); ``?history=true`` adds
  each endpoint's last telemetry samples for sparklines, which the page then extends itself.
- ``GET /v1/history``: recent revisions of the policy objects, newest first, each with a diff
  against the revision before and who made it (``api.changes``).
- ``GET /v1/admission``: per route with service classes, what each class is admitted now,
  since when, and the pressure behind it (``api.admission``).
- ``GET /v1/virtualmodels``: per virtual model the threshold in force, the share it aims at
  and what Envoys reported: requests by target, scores, escalations, and the spend saved
  against the large model's price (``api.difficulty``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from api.admission import admission_view
from api.auth import Principal, require
from api.changes import ChangeLog
from api.difficulty import virtual_models_view
from compiler import RoutingPlan
from controlplane.audit import AuditLog
from controlplane.etcd.store import Store
from controlplane.reconcile.history import TelemetryHistory
from controlplane.reconcile.loop import Reconciler
from policies import Endpoint
from signals import PolicyState
from signals.savings import virtual_savings
from signals.spend import Spend, SpendKey, Window
from signals.state import is_external, pool_endpoints
from signals.weights import WeightDecision
from xdsserver.difficultylog import VirtualModelCounts

UI_DIR = Path(__file__).with_name("ui")
"""The console's static files."""

Reader = Annotated[Principal, Depends(require("read"))]


# --------------------------------------------------------------------------------------------
# Endpoints view (pure)
# --------------------------------------------------------------------------------------------


def _reasons(
    endpoint: Endpoint, decision: WeightDecision | None, telemetry_balanced: bool, max_age: float
) -> list[str]:
    """Why an endpoint gets the weight and health it does, in words for an operator."""
    reasons = []
    if endpoint.health != "healthy":
        reasons.append(f"{endpoint.health}: set on the endpoint")
    if decision is not None:
        if decision.degraded:
            reasons.append("degraded: saturated (queue or KV cache over its bound)")
        if decision.neutral:
            if decision.age is None:
                reasons.append("no telemetry: static weight")
            else:
                reasons.append(
                    f"telemetry stale ({decision.age:.0f}s old, max {max_age:g}s): static weight"
                )
        elif decision.factor < 1 and decision.speed is not None:
            # A pool behind session affinity: capacity, learned from speed, not load.
            reasons.append(
                f"slower than the pool's median (last speed {decision.speed:.2f}): capacity "
                f"{decision.factor:.0%} of static"
            )
        elif decision.factor < 1:
            reasons.append(
                f"load {decision.load:.2f}: weight cut to {decision.factor:.0%} of static"
            )
    elif telemetry_balanced:
        reasons.append("no telemetry: static weight")
    return reasons


def endpoints_view(
    state: PolicyState | None,
    plan: RoutingPlan | None,
    history: TelemetryHistory | None = None,
) -> list[dict[str, Any]]:
    """Every pool with its endpoints, as the console shows them; pure."""
    if state is None or plan is None:
        return []
    used_by: dict[str, list[str]] = {}
    balancing: dict[str, set[str]] = {}
    for policy in state.policies.values():
        for route in policy.spec.routes:
            for tier in route.tiers:
                for target in tier.pools:
                    used_by.setdefault(target.pool, []).append(
                        f"{policy.metadata.name}/{route.name}"
                    )
                    balancing.setdefault(target.pool, set()).add(route.balancing)
    pools = []
    for name in sorted(state.pools):
        pool = state.pools[name]
        registered = state.registered.get(name, {})
        registered_ids = {endpoint.key: endpoint_id for endpoint_id, endpoint in registered.items()}
        decisions = plan.weights.get(name, {})
        telemetry = state.telemetry.get(name, {})
        telemetry_balanced = "telemetry" in balancing.get(name, set())
        max_age = pool.spec.telemetry.max_age if pool.spec.telemetry else 10.0
        rows = []
        for endpoint in pool_endpoints(pool, registered):
            key = endpoint.key
            decision = decisions.get(key)
            record = telemetry.get(registered_ids.get(key, key)) or telemetry.get(key)
            row: dict[str, Any] = {
                "id": registered_ids.get(key, key),
                "address": endpoint.address,
                "port": endpoint.port,
                "source": "registered" if key in registered_ids else "static",
                "weight": endpoint.weight,
                "effectiveWeight": decision.weight if decision is not None else endpoint.weight,
                "health": endpoint.health,
                "effectiveHealth": "degraded"
                if decision is not None and decision.degraded
                else endpoint.health,
                "load": decision.load if decision is not None else None,
                "reasons": _reasons(endpoint, decision, telemetry_balanced, max_age),
                "telemetry": record.model_dump(exclude_none=True) if record else None,
                # What the replica serves: its pool's list, else what its agent reports; and
                # the adapters its agent reports loaded.
                "models": list(pool.spec.models)
                or (list(record.models) if record and record.models is not None else None),
                "adapters": list(record.adapters)
                if record and record.adapters is not None
                else None,
                "modelsError": record.models_error if record else None,
                "telemetryAge": round(state.now - record.at, 3) if record else None,
            }
            if history is not None:
                row["history"] = history.samples(name, registered_ids.get(key, key))
            rows.append(row)
        pools.append(
            {
                "name": name,
                "models": list(pool.spec.models),
                "external": is_external(pool),
                "balancing": sorted(balancing.get(name, set())),
                "usedBy": used_by.get(name, []),
                "telemetryMaxAge": max_age,
                "endpoints": rows,
            }
        )
    return pools


# --------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------


def add_console_routes(
    app: FastAPI,
    store: Store,
    reconciler: Reconciler,
    audit: AuditLog | None = None,
    virtual_model_counts: Callable[[], Mapping[str, VirtualModelCounts]] | None = None,
    spend: Callable[[Window | None, float], Mapping[SpendKey, Spend]] | None = None,
) -> None:
    """The console's read views under /v1, and the page at /ui."""
    tags: list[str | Any] = ["console"]
    changelog = ChangeLog(store, audit)

    @app.get(
        "/v1/endpoints",
        tags=tags,
        operation_id="endpoints_view",
        summary="Every pool's endpoints: static and effective weight and health, the telemetry "
        "behind them, and why",
    )
    async def endpoints(
        _: Reader,
        history: Annotated[
            bool, Query(description="Add each endpoint's recent telemetry samples.")
        ] = False,
    ) -> dict[str, Any]:
        build = reconciler.last_build
        return {
            "revision": build.revision,
            "builtAt": build.at or None,
            "pools": endpoints_view(
                reconciler.state,
                reconciler.plan,
                reconciler.telemetry_history if history else None,
            ),
        }

    @app.get(
        "/v1/history",
        tags=tags,
        operation_id="history",
        summary="Recent revisions of the policy objects with diffs and who made them, newest "
        "first (from etcd's revision history, kept until compaction, joined with the audit log)",
    )
    async def history(
        _: Reader,
        limit: Annotated[int, Query(ge=1, le=500, description="Most entries returned.")] = 100,
    ) -> dict[str, Any]:
        return await changelog.changes(limit)

    @app.get(
        "/v1/admission",
        tags=tags,
        operation_id="admission",
        summary="Service classes per route: each class's objective, action and state now "
        "(admitted, restricted, shed, diverted, queued) and since when, and the pressure "
        "signals against their bounds",
    )
    async def admission(_: Reader) -> dict[str, Any]:
        build = reconciler.last_build
        return {
            "revision": build.revision,
            "builtAt": build.at or None,
            "now": reconciler.clock(),
            "policies": admission_view(reconciler.state, reconciler.plan),
        }

    @app.get(
        "/v1/virtualmodels",
        tags=tags,
        operation_id="virtual_models",
        summary="Virtual models: targets, scorer, the threshold in force and the large share "
        "it aims at, and what Envoys reported (requests by target, score sources, cap and "
        "floor overrides, escalations, score distribution), and the spend saved against "
        "the large model's price",
    )
    async def virtual_models(_: Reader) -> dict[str, Any]:
        build = reconciler.last_build
        counts = virtual_model_counts() if virtual_model_counts is not None else {}
        state = reconciler.state
        savings = (
            virtual_savings(state, spend(None, time.time()))
            if spend is not None and state is not None
            else None
        )
        return {
            "revision": build.revision,
            "builtAt": build.at or None,
            "virtualModels": virtual_models_view(
                state, reconciler.plan, counts, reconciler.difficulty, savings
            ),
        }

    @app.get(
        "/v1/whoami",
        tags=tags,
        operation_id="whoami",
        summary="The token's name and role (the console shows actions to admins only)",
    )
    async def whoami(principal: Reader) -> dict[str, str]:
        return {"name": principal.name, "role": principal.role}

    @app.get("/ui", include_in_schema=False)
    async def ui_root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")
