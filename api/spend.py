"""REST view of spend: tokens and their cost by tenant, model, pool, class or route, summed
over every kvpilot replica, for all time or the current calendar window (UTC)."""

from __future__ import annotations

import time
from typing import Annotated, Any, cast

from fastapi import FastAPI, Query

from api.context import ApiContext, ApiError, Reader
from signals.capacity import pool_costs
from signals.spend import WINDOWS, Spend, Window, group, window_bounds

GROUPS = ("tenant", "model", "pool", "class", "route")
"""What rows may be grouped by (``class`` is the service class)."""
_FIELDS = {"class": "service_class"}


def spend_view(
    context: ApiContext, window: str, by: str, at: float | None = None
) -> dict[str, Any]:
    """The body of ``GET /v1/spend``; also what the console shows."""
    if window != "total" and window not in WINDOWS:
        raise ApiError(422, f"window {window!r} is not one of total, {', '.join(WINDOWS)}")
    names = [part.strip() for part in by.split(",") if part.strip()]
    unknown = [name for name in names if name not in GROUPS]
    if unknown or not names:
        raise ApiError(
            422, f"by {by!r}: group by one or more of {', '.join(GROUPS)}, comma-separated"
        )
    now = time.time() if at is None else at
    kind: Window | None = None if window == "total" else cast(Window, window)
    rows = context.spend(kind, now) if context.spend is not None else {}
    grouped = group(rows, [*(_FIELDS.get(name, name) for name in names), "currency"])
    body: dict[str, Any] = {"window": window, "by": names}
    if kind is not None:
        start, end = window_bounds(kind, now)
        body["start"] = start.isoformat().replace("+00:00", "Z")
        body["end"] = end.isoformat().replace("+00:00", "Z")
    totals: dict[str, Spend] = {}
    out = []
    for values, spend in sorted(grouped.items()):
        *labels, currency = values
        totals.setdefault(currency, Spend()).add(spend)
        out.append(
            {**dict(zip(names, labels, strict=True)), "currency": currency, **spend.as_json()}
        )
    body["rows"] = out
    state = context.reconciler.state
    if state is not None:
        elapsed = now - window_bounds(kind, now)[0].timestamp() if kind is not None else None
        body["pools"] = [cost.as_json() for cost in pool_costs(state, rows, elapsed)]
    body["totals"] = [
        {"currency": currency, **spend.as_json()} for currency, spend in sorted(totals.items())
    ]
    return body


def add_spend_routes(app: FastAPI, context: ApiContext) -> None:
    @app.get(
        "/v1/spend",
        tags=["spend"],
        operation_id="spend",
        summary="Tokens and their cost, summed over every kvpilot replica",
    )
    async def spend(
        _: Reader,
        window: Annotated[
            str,
            Query(
                description="total, or the current calendar window (UTC): minute, hour, day, month."
            ),
        ] = "total",
        by: Annotated[
            str,
            Query(description="Comma-separated: tenant, model, pool, class, route."),
        ] = "tenant,model,pool",
    ) -> dict[str, Any]:
        return spend_view(context, window, by)
