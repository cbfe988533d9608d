"""The REST API: CRUD on policy objects with revisions (``api.objects``), endpoint
registration (``api.endpoints``), health and status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any

import prometheus_client
from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from api.admission import restricted_classes
from api.auth import AuthMetrics
from api.console import add_console_routes
from api.context import PATH_RULES, ApiContext, ApiError, FleetName, Reader, unprocessable
from api.endpoints import WeightChange, add_endpoint_routes
from api.objects import add_object_routes, add_preview_route
from api.rollouts import add_rollout_routes, rollout_driver, rollout_summaries
from api.spend import add_spend_routes
from compiler import RoutingPlan
from controlplane.etcd import EtcdError, EtcdOutcomeUnknown, EtcdUnavailable
from controlplane.etcd.keys import InvalidName, UnknownKind, ValueTooLarge
from controlplane.etcd.store import (
    AlreadyExists,
    Contended,
    InvalidValue,
    NotFound,
    RevisionMismatch,
)
from policies import KIND_PATHS, KINDS, Endpoint, FieldError, PolicyError
from policies.names import GATE_SUFFIX
from policies.validate import field_path
from signals.saturation import exported_bound
from signals.state import PolicyState
from xdsserver.render import snapshot_json

__all__ = ["ApiContext", "create_app"]

log = logging.getLogger(__name__)

READINESS_ETCD_TIMEOUT = 2.0
"""Seconds /readyz waits for etcd before calling it unreachable."""


def create_app(context: ApiContext) -> FastAPI:
    """The REST API over ``context``. Pure construction: no I/O until requests arrive."""
    app = FastAPI(
        title="kvpilot",
        version="1",
        description="Routing policy for fleets of Envoys in front of LLM inference backends.",
    )
    app.state.auth = context.auth
    app.state.write_limit = context.write_limit
    app.state.auth_metrics = AuthMetrics(
        context.metrics_registry
        if context.metrics_registry is not None
        else prometheus_client.CollectorRegistry()
    )
    if context.cors_origins:
        # Bearer tokens travel in a header, not cookies: no credentials mode is needed.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(context.cors_origins),
            allow_methods=["GET", "POST", "PUT", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "If-Match"],
            expose_headers=["ETag"],
            max_age=600,
        )
    if not context.auth.enabled:
        log.warning(
            "REST API authentication is DISABLED (--insecure-no-auth): anyone who can reach "
            "the API can change routing; use this only on a trusted machine"
        )
    _install_error_handlers(app)
    _add_health_routes(app, context)
    for kind, path in KIND_PATHS.items():
        add_object_routes(app, context, kind, path)
    add_preview_route(app, context)
    add_endpoint_routes(app, context)
    add_rollout_routes(app, context)
    add_spend_routes(app, context)
    _add_status_routes(app, context)
    add_console_routes(
        app,
        context.store,
        context.reconciler,
        context.audit,
        context.virtual_model_counts,
        context.spend,
    )
    _add_audit_routes(app, context)
    _install_openapi(app)
    return app


def _validation_message(item: Mapping[str, Any]) -> str:
    """FastAPI's message, or for a path parameter the rule it breaks, in words."""
    loc = tuple(item.get("loc", ()))
    if len(loc) == 2 and loc[0] == "path" and loc[1] in PATH_RULES:
        return f"{item.get('input')!r} is not a valid {loc[1]}: use {PATH_RULES[loc[1]]}"
    return str(item.get("msg", "invalid"))


def _check_after_unknown_outcome(request: Request) -> str:
    """Where a client reads back what an unconfirmed write did."""
    path = request.url.path.removesuffix("/weight")
    parts = path.strip("/").split("/")
    if len(parts) == 5 and parts[3] == "endpoints":
        return "/" + "/".join(parts[:4])  # the pool's registered endpoints
    if request.method == "POST":
        return f"{path}/<name>"
    return path


def _install_error_handlers(app: FastAPI) -> None:
    def detail(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"detail": message}, status_code=status, headers=headers)

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return detail(exc.status, exc.message, exc.headers)

    async def outcome_unknown(request: Request, exc: Exception) -> JSONResponse:
        log.warning("write with unknown outcome: %s %s: %s", request.method, request.url, exc)
        check = _check_after_unknown_outcome(request)
        return detail(
            503,
            f"the outcome of this write is unknown: {exc}. Check before retrying: GET {check} "
            "and compare its ETag (revision) with the one you wrote against; etcd may still "
            "apply the write when it recovers.",
        )

    async def policy_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, PolicyError)
        return unprocessable(exc.errors)

    async def request_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            FieldError(field_path(item.get("loc", ())), _validation_message(item))
            for item in exc.errors()
        ]
        return unprocessable(errors)

    def status_for(status: int) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
        async def handler(request: Request, exc: Exception) -> JSONResponse:
            return detail(status, str(exc))

        return handler

    async def etcd_error(request: Request, exc: Exception) -> JSONResponse:
        log.warning("etcd request failed: %s", exc)
        return detail(503, f"etcd failed: {exc}")

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(PolicyError, policy_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(AlreadyExists, status_for(409))
    app.add_exception_handler(RevisionMismatch, status_for(412))
    app.add_exception_handler(NotFound, status_for(412))
    app.add_exception_handler(InvalidName, status_for(400))
    app.add_exception_handler(UnknownKind, status_for(404))
    # Garbage in etcd (written by another tool): the client can fix it by replacing the object.
    app.add_exception_handler(InvalidValue, status_for(409))
    app.add_exception_handler(ValueTooLarge, status_for(413))
    app.add_exception_handler(Contended, status_for(409))
    app.add_exception_handler(EtcdOutcomeUnknown, outcome_unknown)
    app.add_exception_handler(EtcdUnavailable, status_for(503))
    app.add_exception_handler(EtcdError, etcd_error)


def _add_health_routes(app: FastAPI, context: ApiContext) -> None:
    @app.get("/healthz", tags=["health"], summary="The process is alive")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
        summary="etcd answers and the first snapshot is built",
        responses={503: {"description": "Not ready; the body says why."}},
    )
    async def readyz() -> JSONResponse:
        try:
            async with asyncio.timeout(READINESS_ETCD_TIMEOUT):
                await context.store.status()
        except (EtcdError, TimeoutError) as error:
            reason = str(error) or f"etcd did not answer within {READINESS_ETCD_TIMEOUT:g}s"
            return JSONResponse({"detail": f"etcd is unreachable: {reason}"}, status_code=503)
        if not context.reconciler.ready:
            return JSONResponse(
                {"detail": "the first snapshot has not been built yet"}, status_code=503
            )
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics")
    async def metrics() -> Response:
        registry = context.metrics_registry or prometheus_client.REGISTRY
        return Response(
            prometheus_client.generate_latest(registry),
            media_type=prometheus_client.CONTENT_TYPE_LATEST,
        )


def _add_status_routes(app: FastAPI, context: ApiContext) -> None:
    reconciler = context.reconciler
    tags: list[str | Any] = ["status"]

    @app.get(
        "/v1/fleets/{fleet}/config",
        tags=tags,
        operation_id="fleet_config",
        summary="The Envoy resources served to a fleet now, with per-type versions",
    )
    async def fleet_config(fleet: FleetName, _: Reader) -> dict[str, Any]:
        snapshot = reconciler.cache.snapshot_for(fleet)
        if snapshot is None:
            raise ApiError(404, f"no configuration is served to fleet {fleet!r} yet")
        own = fleet in reconciler.cache.fleets()
        served = fleet if own else reconciler.cache.default_fleet
        return {"fleet": fleet, "servedFrom": served, **snapshot_json(snapshot)}

    @app.get(
        "/v1/status",
        tags=tags,
        operation_id="status",
        summary="Connected Envoys, invalid objects in etcd, plan diagnostics, last build",
    )
    async def status(_: Reader) -> dict[str, Any]:
        plan = reconciler.plan
        build = reconciler.last_build
        driver = rollout_driver(context) or {}
        return {
            "ready": reconciler.ready,
            "replica": context.replica_id,
            "etcd": {
                "endpoints": list(context.store.etcd_endpoints),
                "embedded": context.etcd_embedded,
                "watching": context.etcd_watching() if context.etcd_watching else None,
            },
            "envoys": _envoys(context),
            "refusedEnvoys": context.connections.as_dict()["refused"],
            "invalidObjects": [dataclasses.asdict(e) for e in reconciler.errors.values()],
            "rolloutDriver": driver.get("replica"),
            "rolloutDriverSince": driver.get("since"),
            "rollouts": rollout_summaries(context),
            "diagnostics": [dataclasses.asdict(d) for d in plan.diagnostics] if plan else [],
            "restrictedClasses": restricted_classes(plan),
            "saturation": _saturation(plan),
            "unreadModelLists": _unread_model_lists(reconciler.state),
            "spill": _spill(plan),
            "overflow": _overflow(plan),
            "lastBuild": {
                "revision": build.revision,
                "at": build.at or None,
                "ageSeconds": round(time.time() - build.at, 3) if build.at else None,
                "seconds": build.seconds,
                "fastPath": build.path != "full",
                "path": build.path,
                "fleets": build.fleets,
                "defaultFleet": reconciler.cache.default_fleet,
            },
        }


def _unread_model_lists(state: PolicyState | None) -> list[dict[str, Any]]:
    """Endpoints whose agent could not read the model list on its last try: routing keeps
    the last list read (``models``, ``adapters``) until it can."""
    if state is None:
        return []
    return [
        {
            "pool": pool,
            "endpoint": endpoint,
            "error": record.models_error,
            "models": list(record.models or ()),
            "adapters": list(record.adapters or ()),
            "at": record.at,
        }
        for pool, records in sorted(state.telemetry.items())
        for endpoint, record in sorted(records.items())
        if record.models_error
    ]


def _saturation(plan: RoutingPlan | None) -> list[dict[str, Any]]:
    """Per telemetry route with a saturated bound: whether its session requests take it now,
    the batch fill that decided it, the fill that saturates the route, and since when; for a
    capacity-bound route also its bound and the bound its batches allow, or that its batches
    are too small for the ladder and it takes the fixed bounds."""
    if plan is None:
        return []
    return [
        {
            "route": route,
            "saturated": decision.saturated,
            "batchFill": decision.fill,
            "saturatedAt": decision.bound,
            "since": decision.since if math.isfinite(decision.since) else None,
            # capacityBound routes: the bound session requests take (0: none, the ladder's
            # top rung), and the one the batch allows this round (100 x batch size / mean in
            # flight); null on other routes.
            "boundedLoad": exported_bound(decision.factor) if decision.factor else None,
            "fitsBatchAt": decision.wanted if decision.factor else None,
            # capacityBound routes: whether they take the ladder or, at batches too small
            # for it, the two fixed bounds, and why ("batch 8: ladder needs > 16; fixed
            # bounds"); null on other routes.
            "ladder": decision.ladder,
            "boundPath": decision.path,
        }
        for route, decision in sorted(plan.saturation.items())
    ]


def _spill(plan: RoutingPlan | None) -> list[dict[str, Any]]:
    """Per located fleet and route: the share of the fleet's traffic its own locality keeps
    (the rest spills to the next priority), the replicas it has, their batch fill, whether
    it is back from an outage and ramping, and, with feed-forward, the fleet's arrival rate,
    its locality's capacity (requests per second) with its two parts, the fill loop's
    correction, the queue in the locality's replicas with the share its drain takes, and the
    cluster's mean load with the level the locality was given."""
    if plan is None:
        return []
    return [
        {
            "fleetRoute": key,
            "keep": decision.keep,
            "localReplicas": decision.local,
            "batchFill": decision.fill,
            "outage": decision.outage,
            "since": decision.since if math.isfinite(decision.since) else None,
            "arrivals": decision.arrivals,
            "capacity": decision.capacity,
            "trim": decision.trim,
            # Why the share was kept: the capacity's two parts (slots over service time,
            # and what the replicas completed per second), the requests waiting in them and
            # what the drain of that queue takes off the locality's share.
            "slotCapacity": decision.slot_capacity,
            "completed": decision.completed,
            "queued": decision.queued,
            "drain": decision.drain,
            # The cluster's mean load, and the share of its capacity the locality was given:
            # 0.97, or that mean while it levels with a cluster whose other replicas have room.
            "meanLoad": decision.mean_load,
            "level": decision.level,
            "balancing": decision.balancing,
        }
        for key, decision in sorted(plan.spill.items())
    ]


def _overflow(plan: RoutingPlan | None) -> list[dict[str, Any]]:
    """Per route with overflow: what sets its paid share (``fill``: the loop on the owned
    replicas' pressure; ``arrivals``: the route's arrival rate against their capacity), the
    shares of plain requests and conversations sent to the paid pool that takes them, the
    pressure, and with ``arrivals`` the demand, the capacity (requests per second, and
    whether it was measured at a full batch or is the prior; with ``workPerRequest``, the
    mean work of a request, both were counted in work and are shown at the current mix of
    kinds), the share of the demand sent
    to paid pools, the owned replicas' queue and the rate sent to paid to drain it (beyond
    the TTFT objective's queue) and why; and the route's gate (``maxInFlight``), where it has
    one in force, with what set it under ``maxInFlight: auto`` (``gateAuto``)."""
    if plan is None:
        return []
    gates = {
        cluster.name.removesuffix(GATE_SUFFIX): cluster.circuit_breakers.max_requests
        for fleet in plan.fleets
        for cluster in fleet.clusters
        if cluster.kind == "gate"
    }
    out = []
    for route, decision in sorted(plan.overflow.items()):
        entry: dict[str, Any] = {
            "route": route,
            "signal": decision.signal,
            "provider": decision.provider or None,
            "requests": decision.plain,
            "sessions": decision.sessions,
            "pressure": decision.pressure,
            "resting": sorted(decision.resting),
            # The gate's limit per Envoy (overflow.maxInFlight); None: no gate.
            "gate": {"maxInFlight": gates[route]} if route in gates else None,
        }
        if route in plan.gate_auto:
            # maxInFlight: auto: what set it (no gate while no batch size is known).
            slots, envoys = plan.gate_auto[route]
            entry["gateAuto"] = {"batchSlots": slots, "envoys": envoys}
        arrivals = decision.arrivals
        if arrivals is not None:
            entry.update(
                demand=arrivals.demand,
                capacity=arrivals.capacity,
                capacityMeasured=arrivals.measured,
                workPerRequest=arrivals.work,
                prefillWeight=arrivals.prefill_weight,
                prefillWeightSource=arrivals.weight_source,
                paidShare=arrivals.paid,
                trim=arrivals.trim,
                queued=arrivals.queued,
                drain=arrivals.drain,
                why=arrivals.why,
            )
        out.append(entry)
    return out


def _add_audit_routes(app: FastAPI, context: ApiContext) -> None:
    @app.get(
        "/v1/audit",
        tags=["audit"],
        operation_id="audit",
        summary="Accepted writes, newest first: who (token name), when, what, revisions, diff",
    )
    async def audit(
        _: Reader,
        limit: Annotated[int, Query(ge=1, le=1000, description="Entries to return.")] = 100,
    ) -> dict[str, Any]:
        if context.audit is None:
            raise ApiError(404, "this kvpilot keeps no audit log")
        return {"items": await context.audit.entries(limit=limit)}


def _envoys(context: ApiContext) -> list[dict[str, Any]]:
    """This replica's Envoys as they are now, then other replicas' as they last published them."""
    own = [
        {**connection, "replica": context.replica_id}
        for connection in context.connections.as_dict()["connections"]
    ]
    if context.envoy_records is None:
        return own
    others = [r for r in context.envoy_records() if r.get("replica") != context.replica_id]
    return own + others


def _install_openapi(app: FastAPI) -> None:
    """Add the policy models' JSON schemas, which the hand-parsed request bodies refer to."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        models: list[tuple[type[BaseModel], Any]] = [
            (model, "validation") for model in (*KINDS.values(), Endpoint, WeightChange)
        ]
        _, definitions = models_json_schema(models, ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in definitions.get("$defs", {}).items():
            components.setdefault(name, definition)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
