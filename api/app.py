"""The REST API: CRUD on policy objects with revisions, endpoint registration, status.

Every object lives in etcd under its kind and name; its etcd ``mod_revision`` is its ETag, and
writes that carry ``If-Match`` fail with 412 instead of silently overwriting someone else's
change. Bodies are validated with ``policies.parse_object`` before anything is written: an
invalid body gets 422 with the field path of every problem, and etcd is left untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import prometheus_client
from fastapi import Depends, FastAPI, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

from api.auth import AuthConfig, AuthMetrics, Principal, WriteRateLimit, require
from api.preview import preview, snapshot_json
from controlplane.audit import AuditLog
from controlplane.etcd import EtcdClient, EtcdError, EtcdUnavailable, LeaseNotFoundError
from controlplane.reconcile import Reconciler
from controlplane.store import (
    Actor,
    AlreadyExists,
    InvalidName,
    InvalidValue,
    NotFound,
    RevisionMismatch,
    Store,
    StoredObject,
    UnknownKind,
    decode_json,
)
from policies import (
    KIND_PATHS,
    KINDS,
    Endpoint,
    FieldError,
    PolicyError,
    PolicyObject,
    PolicyState,
    Pool,
    parse_object,
)
from policies.validate import field_errors, field_path
from xdsserver.status import ConnectionRegistry

log = logging.getLogger(__name__)

READINESS_ETCD_TIMEOUT = 2.0
"""Seconds /readyz waits for etcd before calling it unreachable."""
WEIGHT_CAS_ATTEMPTS = 10
"""Compare-and-swap attempts when a weight change rewrites a Pool that others also edit."""


Reader = Annotated[Principal, Depends(require("read"))]
Admin = Annotated[Principal, Depends(require("admin"))]
DryRun = Annotated[
    bool,
    Query(
        alias="dryRun",
        description="Validate and return the Envoy resources the change would produce, "
        "without writing anything.",
    ),
]
IfMatch = Annotated[
    str | None,
    Header(
        alias="If-Match",
        description='The ETag (revision) you read, for example "42": the write fails with 412 '
        "if the object changed since.",
    ),
]
ObjectName = Annotated[str, Path(description="Object name.")]


@dataclass
class ApiContext:
    """What the API works on; the daemon builds it, tests build their own."""

    store: Store
    reconciler: Reconciler
    connections: ConnectionRegistry
    auth: AuthConfig
    metrics_registry: prometheus_client.CollectorRegistry | None = None
    etcd: EtcdClient | None = None
    """For readiness: /readyz asks it whether etcd answers."""
    replica_id: str = ""
    """This kvpilot replica's id, as its Envoy status records in etcd carry it."""
    envoy_records: Callable[[], list[dict[str, Any]]] | None = None
    """The Envoy status records every replica publishes to etcd
    (`controlplane.envoystatus`): with them /v1/status lists the Envoys of all replicas."""
    audit: AuditLog | None = None
    """Where /v1/audit reads from; the store's ``on_write`` writes to it."""
    write_limit: WriteRateLimit | None = None
    """Per-token write rate limit; None: unlimited."""
    cors_origins: Sequence[str] = ()
    """Browser origins allowed to call the API; empty: CORS stays closed."""


class WeightChange(BaseModel):
    """A new load-balancing weight for one endpoint."""

    model_config = ConfigDict(extra="forbid")

    weight: int = Field(ge=1, le=10_000, description="Relative weight within the pool, 1-10000.")


class ApiError(Exception):
    """An error answered with ``{"detail": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _etag(revision: int) -> str:
    return f'"{revision}"'


def _parse_if_match(value: str | None) -> int | str | None:
    """``"42"``, ``W/"42"`` or ``42`` -> 42; ``*`` -> "*"; absent -> None."""
    if value is None:
        return None
    text = value.strip()
    if text == "*":
        return "*"
    text = text.removeprefix("W/").strip('"')
    if not text.isdigit():
        raise ApiError(
            400,
            f"If-Match {value!r} is not a kvpilot ETag: send the ETag header of a GET, "
            'for example If-Match: "42"',
        )
    return int(text)


def _validation_detail(errors: list[FieldError]) -> list[dict[str, str]]:
    return [{"loc": error.path, "msg": error.message} for error in errors]


def _unprocessable(errors: list[FieldError]) -> JSONResponse:
    return JSONResponse({"detail": _validation_detail(errors)}, status_code=422)


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and they cannot be written back.
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number")
    return value


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "the request needs a JSON body")
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


def _parse_for_kind(data: Any, kind: str) -> PolicyObject:
    """Validate ``data`` as a ``kind`` object; ``kind`` may be left out of the body."""
    if isinstance(data, dict) and "kind" not in data:
        data = {**data, "kind": kind}
    obj = parse_object(data)
    if obj.kind != kind:
        raise PolicyError([FieldError("kind", f"this path takes {kind} objects, not {obj.kind}")])
    return obj


def _dump(obj: PolicyObject | Endpoint) -> dict[str, Any]:
    return obj.model_dump(mode="json", by_alias=True)


def _object_response(stored: StoredObject, status: int = 200) -> JSONResponse:
    return JSONResponse(stored.body, status_code=status, headers={"ETag": _etag(stored.revision)})


async def _current_objects(
    store: Store,
) -> tuple[dict[tuple[str, str], PolicyObject], dict[str, dict[str, Endpoint]]]:
    """Every valid object and registered endpoint in etcd now (invalid values are skipped,
    as the daemon skips them)."""
    objects: dict[tuple[str, str], PolicyObject] = {}
    kvs, _ = await store.client.get_prefix(store.keys.absolute("objects/"))
    for kv in kvs:
        parts = store.keys.relative(kv.key).split("/")
        body = decode_json(kv)
        if len(parts) != 3 or body is None:
            continue
        try:
            obj = parse_object(body)
        except PolicyError:
            continue
        if KIND_PATHS.get(obj.kind) == parts[1] and obj.metadata.name == parts[2]:
            objects[(obj.kind, obj.metadata.name)] = obj
    registered: dict[str, dict[str, Endpoint]] = {}
    kvs, _ = await store.client.get_prefix(store.keys.absolute("endpoints/"))
    for kv in kvs:
        parts = store.keys.relative(kv.key).split("/")
        if len(parts) != 3:
            continue
        try:
            endpoint = Endpoint.model_validate_json(kv.value)
        except ValidationError:
            continue
        registered.setdefault(parts[1], {})[parts[2]] = endpoint
    return objects, registered


async def _dry_run(
    store: Store, kind: str, name: str, replacement: PolicyObject | None
) -> dict[str, Any]:
    objects, registered = await _current_objects(store)
    if replacement is None:
        objects.pop((kind, name), None)
    else:
        objects[(kind, name)] = replacement
    return {
        "dryRun": True,
        **preview(PolicyState.from_objects(objects.values(), registered=registered)),
    }


async def _expected_revision(
    store: Store, kind: str, name: str, if_match: str | None
) -> int | None:
    expected = _parse_if_match(if_match)
    if expected != "*":
        return expected if isinstance(expected, int) else None
    current = await store.get(kind, name)
    if current is None:
        raise ApiError(412, f"{kind} {name!r} does not exist, and If-Match: * needs it to")
    return current.revision


def _endpoints_prefix(store: Store, pool: str) -> bytes:
    return store.keys.absolute(store.keys.endpoint(pool, "-").rsplit("/", 1)[0] + "/")


async def _lease_ttl(client: EtcdClient, lease: int) -> int | None:
    """Seconds left on an endpoint's lease; None for a registration without a TTL."""
    if not lease:
        return None
    return await client.lease_time_to_live(lease)


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------


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
        _add_object_routes(app, context, kind, path)
    _add_endpoint_routes(app, context)
    _add_status_routes(app, context)
    _add_audit_routes(app, context)
    _install_openapi(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    def detail(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"detail": message}, status_code=status, headers=headers)

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return detail(exc.status, exc.message)

    async def policy_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, PolicyError)
        return _unprocessable(exc.errors)

    async def request_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [
            FieldError(field_path(item.get("loc", ())), str(item.get("msg", "invalid")))
            for item in exc.errors()
        ]
        return _unprocessable(errors)

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
    app.add_exception_handler(InvalidValue, status_for(500))
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
        if context.etcd is not None:
            try:
                await asyncio.wait_for(context.etcd.status(), READINESS_ETCD_TIMEOUT)
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


def _add_object_routes(app: FastAPI, context: ApiContext, kind: str, path: str) -> None:
    store = context.store
    base = f"/v1/{path}"
    schema_ref = {"$ref": f"#/components/schemas/{kind}"}
    body_doc = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema_ref}},
        }
    }
    tags: list[str | Any] = [path]

    async def list_objects(_: Reader) -> dict[str, Any]:
        objects, revision = await store.list(kind)
        return {"items": [obj.body for obj in objects], "revision": revision}

    async def get_object(name: ObjectName, _: Reader) -> JSONResponse:
        stored = await store.get(kind, name)
        if stored is None:
            raise ApiError(404, f"{kind} {name!r} does not exist")
        return _object_response(stored)

    async def create_object(
        request: Request, principal: Admin, dry_run: DryRun = False
    ) -> JSONResponse:
        obj = _parse_for_kind(await _json_body(request), kind)
        name = obj.metadata.name
        if dry_run:
            if await store.get(kind, name) is not None:
                raise ApiError(409, f"{kind} {name!r} already exists; PUT replaces it")
            return JSONResponse(await _dry_run(store, kind, name, obj))
        stored = await store.create(
            kind, name, _dump(obj), actor=Actor(principal.name, f"create_{path}")
        )
        log.info("created %s %r at revision %d", kind, name, stored.revision)
        return _object_response(stored, 201)

    async def replace_object(
        name: ObjectName,
        request: Request,
        principal: Admin,
        if_match: IfMatch = None,
        dry_run: DryRun = False,
    ) -> JSONResponse:
        obj = _parse_for_kind(await _json_body(request), kind)
        if obj.metadata.name != name:
            raise PolicyError(
                [
                    FieldError(
                        "metadata.name",
                        f"the body names {obj.metadata.name!r} but the path names {name!r}; "
                        "rename with DELETE and POST",
                    )
                ]
            )
        expected = await _expected_revision(store, kind, name, if_match)
        if dry_run:
            if expected is not None:
                current = await store.get(kind, name)
                if current is None or current.revision != expected:
                    raise ApiError(
                        412, f"{kind} {name!r} is not at revision {expected}; fetch it again"
                    )
            return JSONResponse(await _dry_run(store, kind, name, obj))
        stored = await store.replace(
            kind,
            name,
            _dump(obj),
            expect_revision=expected,
            actor=Actor(principal.name, f"replace_{path}"),
        )
        created = stored.created_revision == stored.revision
        log.info(
            "%s %s %r at revision %d",
            "created" if created else "replaced",
            kind,
            name,
            stored.revision,
        )
        return _object_response(stored, 201 if created else 200)

    async def delete_object(
        name: ObjectName, principal: Admin, if_match: IfMatch = None, dry_run: DryRun = False
    ) -> Response:
        expected = await _expected_revision(store, kind, name, if_match)
        if dry_run:
            current = await store.get(kind, name)
            if current is None:
                raise ApiError(404, f"{kind} {name!r} does not exist")
            if expected is not None and current.revision != expected:
                raise ApiError(
                    412, f"{kind} {name!r} is not at revision {expected}; fetch it again"
                )
            return JSONResponse(await _dry_run(store, kind, name, None))
        if not await store.delete(
            kind, name, expect_revision=expected, actor=Actor(principal.name, f"delete_{path}")
        ):
            raise ApiError(404, f"{kind} {name!r} does not exist")
        log.info("deleted %s %r", kind, name)
        return Response(status_code=204)

    app.add_api_route(
        base,
        list_objects,
        methods=["GET"],
        tags=tags,
        operation_id=f"list_{path}",
        summary=f"List {kind} objects",
    )
    app.add_api_route(
        f"{base}/{{name}}",
        get_object,
        methods=["GET"],
        tags=tags,
        operation_id=f"get_{path}",
        summary=f"Read one {kind} (ETag: its revision)",
        responses={404: {"description": "No such object."}},
    )
    app.add_api_route(
        base,
        create_object,
        methods=["POST"],
        tags=tags,
        operation_id=f"create_{path}",
        summary=f"Create a {kind}",
        status_code=201,
        openapi_extra=body_doc,
        responses={409: {"description": "It exists."}, 422: {"description": "Invalid body."}},
    )
    app.add_api_route(
        f"{base}/{{name}}",
        replace_object,
        methods=["PUT"],
        tags=tags,
        operation_id=f"replace_{path}",
        summary=f"Create or replace a {kind}",
        openapi_extra=body_doc,
        responses={412: {"description": "If-Match failed."}, 422: {"description": "Invalid body."}},
    )
    app.add_api_route(
        f"{base}/{{name}}",
        delete_object,
        methods=["DELETE"],
        tags=tags,
        operation_id=f"delete_{path}",
        summary=f"Delete a {kind}",
        status_code=204,
        responses={
            404: {"description": "No such object."},
            412: {"description": "If-Match failed."},
        },
    )


def _add_endpoint_routes(app: FastAPI, context: ApiContext) -> None:
    store = context.store
    tags: list[str | Any] = ["endpoints"]
    endpoint_doc = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Endpoint"}}},
        }
    }

    @app.get(
        "/v1/pools/{pool}/endpoints",
        tags=tags,
        operation_id="list_endpoints",
        summary="Endpoints registered to a pool (not its static ones)",
    )
    async def list_endpoints(pool: str, _: Reader) -> dict[str, Any]:
        kvs, revision = await store.client.get_prefix(_endpoints_prefix(store, pool))
        items = []
        for kv in kvs:
            endpoint_id = store.keys.relative(kv.key).rsplit("/", 1)[-1]
            items.append(
                {
                    "id": endpoint_id,
                    "endpoint": decode_json(kv),
                    "revision": kv.mod_revision,
                    "lease": kv.lease or None,
                    "ttlSeconds": await _lease_ttl(store.client, kv.lease),
                }
            )
        return {"items": items, "revision": revision}

    @app.put(
        "/v1/pools/{pool}/endpoints/{endpoint_id}",
        tags=tags,
        operation_id="register_endpoint",
        summary="Register an endpoint, optionally under a lease that expires after ttl seconds",
        openapi_extra=endpoint_doc,
    )
    async def register_endpoint(
        pool: str,
        endpoint_id: str,
        request: Request,
        principal: Admin,
        ttl: Annotated[
            int | None,
            Query(ge=1, le=365 * 24 * 3600, description="Lease TTL in seconds; none = forever."),
        ] = None,
    ) -> JSONResponse:
        try:
            endpoint = Endpoint.model_validate(await _json_body(request))
        except ValidationError as error:
            raise PolicyError(field_errors(error)) from None
        body = _dump(endpoint)
        revision, lease = await store.put_endpoint(
            pool, endpoint_id, body, ttl=ttl, actor=Actor(principal.name, "register_endpoint")
        )
        log.info("registered endpoint %s/%s (lease %s)", pool, endpoint_id, lease)
        return JSONResponse(
            {
                "id": endpoint_id,
                "endpoint": body,
                "revision": revision,
                "lease": lease,
                "ttlSeconds": ttl,
            },
            headers={"ETag": _etag(revision)},
        )

    @app.delete(
        "/v1/pools/{pool}/endpoints/{endpoint_id}",
        tags=tags,
        operation_id="deregister_endpoint",
        summary="Remove a registered endpoint",
        status_code=204,
    )
    async def deregister_endpoint(pool: str, endpoint_id: str, principal: Admin) -> Response:
        if not await store.delete_endpoint(
            pool, endpoint_id, actor=Actor(principal.name, "deregister_endpoint")
        ):
            raise ApiError(404, f"endpoint {endpoint_id!r} is not registered to pool {pool!r}")
        log.info("deregistered endpoint %s/%s", pool, endpoint_id)
        return Response(status_code=204)

    @app.put(
        "/v1/pools/{pool}/endpoints/{endpoint_id}/weight",
        tags=tags,
        operation_id="set_endpoint_weight",
        summary="Change one endpoint's weight (registered, or static as address:port)",
    )
    async def set_weight(
        pool: str, endpoint_id: str, change: WeightChange, principal: Admin
    ) -> dict[str, Any]:
        actor = Actor(principal.name, "set_endpoint_weight")
        key = store.keys.absolute(store.keys.endpoint(pool, endpoint_id))
        kv = await store.client.get(key)
        if kv is not None:
            current = decode_json(kv)
            if current is None:
                raise ApiError(
                    500, f"the registration of {endpoint_id!r} is not JSON; re-register it"
                )
            try:
                endpoint = Endpoint.model_validate({**current, "weight": change.weight})
            except ValidationError as error:
                raise PolicyError(field_errors(error)) from None
            try:
                revision, _lease = await store.put_endpoint(
                    pool, endpoint_id, _dump(endpoint), lease=kv.lease or None, actor=actor
                )
            except LeaseNotFoundError:
                raise ApiError(
                    404, f"the registration of {endpoint_id!r} expired while it was being changed"
                ) from None
            log.info("endpoint %s/%s weight -> %d", pool, endpoint_id, change.weight)
            return {
                "pool": pool,
                "id": endpoint_id,
                "source": "registered",
                "weight": change.weight,
                "revision": revision,
            }
        for _attempt in range(WEIGHT_CAS_ATTEMPTS):
            stored = await store.get("Pool", pool)
            if stored is None:
                raise ApiError(
                    404,
                    f"endpoint {endpoint_id!r} is not registered and pool {pool!r} does not exist",
                )
            try:
                pool_obj = _parse_for_kind(stored.body, "Pool")
            except PolicyError as error:
                raise ApiError(
                    409, f"pool {pool!r} in etcd is invalid ({error}); fix it first"
                ) from None
            assert isinstance(pool_obj, Pool)
            endpoints = pool_obj.spec.endpoints
            if not any(endpoint.key == endpoint_id for endpoint in endpoints):
                raise ApiError(
                    404,
                    f"pool {pool!r} has no endpoint {endpoint_id!r}: registered endpoints go by "
                    "their id, static ones by address:port",
                )
            updated = pool_obj.model_copy(
                update={
                    "spec": pool_obj.spec.model_copy(
                        update={
                            "endpoints": [
                                e.model_copy(update={"weight": change.weight})
                                if e.key == endpoint_id
                                else e
                                for e in endpoints
                            ]
                        }
                    )
                }
            )
            try:
                written = await store.replace(
                    "Pool", pool, _dump(updated), expect_revision=stored.revision, actor=actor
                )
            except (RevisionMismatch, NotFound):
                continue
            log.info("pool %s static endpoint %s weight -> %d", pool, endpoint_id, change.weight)
            return {
                "pool": pool,
                "id": endpoint_id,
                "source": "static",
                "weight": change.weight,
                "revision": written.revision,
            }
        raise ApiError(
            409, f"pool {pool!r} kept changing under {WEIGHT_CAS_ATTEMPTS} attempts; retry"
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
    async def fleet_config(fleet: str, _: Reader) -> dict[str, Any]:
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
        return {
            "ready": reconciler.ready,
            "envoys": _envoys(context),
            "refusedEnvoys": context.connections.as_dict()["refused"],
            "invalidObjects": [dataclasses.asdict(e) for e in reconciler.errors.values()],
            "diagnostics": [dataclasses.asdict(d) for d in plan.diagnostics] if plan else [],
            "lastBuild": {
                "revision": build.revision,
                "at": build.at or None,
                "ageSeconds": round(time.time() - build.at, 3) if build.at else None,
                "seconds": build.seconds,
                "fastPath": build.path != "full",
                "path": build.path,
                "fleets": build.fleets,
            },
        }


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
            (model, "validation") for model in (*KINDS.values(), Endpoint)
        ]
        _, definitions = models_json_schema(models, ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in definitions.get("$defs", {}).items():
            components.setdefault(name, definition)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
