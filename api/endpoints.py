"""Endpoint registration (optionally under a lease), and weight and health changes (drain),
for registered and static endpoints alike."""

from __future__ import annotations

import logging
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.context import (
    Admin,
    ApiContext,
    ApiError,
    EndpointId,
    PoolName,
    Reader,
    dump,
    etag,
    json_body,
    parse_for_kind,
    read,
)
from controlplane.etcd import LeaseNotFoundError
from controlplane.etcd.store import Actor, Store, StoredObject
from policies import Endpoint, EndpointHealth, PolicyError, Pool
from policies.validate import field_errors

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


WEIGHT_CAS_ATTEMPTS = 10
"""Compare-and-swap attempts when a weight change rewrites a Pool that others also edit."""


class HealthChange(BaseModel):
    """A new health for one endpoint, as sent to Envoy over EDS."""

    model_config = ConfigDict(extra="forbid")

    health: EndpointHealth = Field(
        description="'draining' or 'unhealthy' take the endpoint out of rotation, 'degraded' "
        "keeps it as a last resort, 'healthy' puts it back."
    )


class WeightChange(BaseModel):
    """A new load-balancing weight for one endpoint."""

    model_config = ConfigDict(extra="forbid")

    weight: int = Field(ge=1, le=10_000, description="Relative weight within the pool, 1-10000.")


def add_endpoint_routes(app: FastAPI, context: ApiContext) -> None:
    store = context.store
    tags: list[str | Any] = ["endpoints"]

    @app.get(
        "/v1/pools/{pool}/endpoints",
        tags=tags,
        operation_id="list_endpoints",
        summary="Endpoints registered to a pool (not its static ones)",
    )
    async def list_endpoints(pool: PoolName, _: Reader) -> JSONResponse:
        (registrations, revision), headers = await read(
            context,
            lambda: store.endpoints(pool),
            lambda items: (store.endpoints_from(items, pool), context.mirror.revision),  # type: ignore[union-attr]
        )
        items = [
            {
                "id": registration.endpoint_id,
                "endpoint": registration.body,
                "revision": registration.revision,
                "lease": registration.lease or None,
                # A lease's time left is etcd's to tell; not known from the mirror.
                "ttlSeconds": None if headers else await store.lease_ttl(registration.lease),
            }
            for registration in registrations
        ]
        return JSONResponse({"items": items, "revision": revision}, headers=headers)

    @app.put(
        "/v1/pools/{pool}/endpoints/{endpoint_id}",
        tags=tags,
        operation_id="register_endpoint",
        summary="Register an endpoint, optionally under a lease that expires after ttl seconds",
        openapi_extra=_body_doc(Endpoint),
    )
    async def register_endpoint(
        pool: PoolName,
        endpoint_id: EndpointId,
        request: Request,
        principal: Admin,
        ttl: Annotated[
            int | None,
            Query(ge=1, le=365 * 24 * 3600, description="Lease TTL in seconds; none = forever."),
        ] = None,
    ) -> JSONResponse:
        endpoint = _validated(Endpoint, await json_body(request))
        body = dump(endpoint)
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
            headers={"ETag": etag(revision)},
        )

    @app.delete(
        "/v1/pools/{pool}/endpoints/{endpoint_id}",
        tags=tags,
        operation_id="deregister_endpoint",
        summary="Remove a registered endpoint",
        status_code=204,
    )
    async def deregister_endpoint(
        pool: PoolName, endpoint_id: EndpointId, principal: Admin
    ) -> Response:
        if not await store.delete_endpoint(
            pool, endpoint_id, actor=Actor(principal.name, "deregister_endpoint")
        ):
            raise ApiError(404, f"endpoint {endpoint_id!r} is not registered to pool {pool!r}")
        log.info("deregistered endpoint %s/%s", pool, endpoint_id)
        return Response(status_code=204)

    _add_endpoint_change(
        app,
        store,
        tags,
        "weight",
        WeightChange,
        "Change one endpoint's weight (registered, or static as address:port)",
    )
    _add_endpoint_change(
        app,
        store,
        tags,
        "health",
        HealthChange,
        "Drain an endpoint (health: draining), take it out (unhealthy) or put it back "
        "(healthy); registered, or static as address:port",
    )


def _add_endpoint_change(
    app: FastAPI,
    store: Store,
    tags: list[str | Any],
    field: str,
    change_model: type[BaseModel],
    summary: str,
) -> None:
    """`PUT /v1/pools/{pool}/endpoints/{endpoint_id}/{field}`: change one field of one endpoint
    (operation `set_endpoint_{field}`), its body a `change_model` whose `field` it sets."""
    operation_id = f"set_endpoint_{field}"

    async def set_field(
        pool: PoolName, endpoint_id: EndpointId, request: Request, principal: Admin
    ) -> dict[str, Any]:
        change = _validated(change_model, await json_body(request))
        changes = {field: getattr(change, field)}
        actor = Actor(principal.name, operation_id)
        return await _update_endpoint(store, pool, endpoint_id, changes, actor)

    app.add_api_route(
        f"/v1/pools/{{pool}}/endpoints/{{endpoint_id}}/{field}",
        set_field,
        methods=["PUT"],
        tags=tags,
        operation_id=operation_id,
        summary=summary,
        openapi_extra=_body_doc(change_model),
    )


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its JSON itself (through `json_body`,
    which bounds its size) and validates it as `model`."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _validated(model: type[M], value: Any) -> M:
    """`value` as a `model`, or the 422 that names each wrong field with a sentence."""
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise PolicyError(field_errors(error)) from None


async def _update_endpoint(
    store: Store, pool: str, endpoint_id: str, changes: dict[str, Any], actor: Actor
) -> dict[str, Any]:
    """Change fields of one endpoint: its registration if it is registered (keeping its
    lease), otherwise its static entry in the Pool (compare-and-swap, retried when others
    edit the Pool)."""
    what = ", ".join(f"{field} -> {value}" for field, value in changes.items())
    registration = await store.get_endpoint(pool, endpoint_id)
    if registration is not None:
        current = registration.body
        if current is None:
            raise ApiError(
                409,
                f"the registration of {endpoint_id!r} in pool {pool!r} is not a JSON object; "
                "register it again (PUT) or DELETE it",
            )
        endpoint = _validated(Endpoint, {**current, **changes})
        try:
            revision, _lease = await store.put_endpoint(
                pool, endpoint_id, dump(endpoint), lease=registration.lease or None, actor=actor
            )
        except LeaseNotFoundError:
            raise ApiError(
                404, f"the registration of {endpoint_id!r} expired while it was being changed"
            ) from None
        log.info("endpoint %s/%s %s", pool, endpoint_id, what)
        return {
            "pool": pool,
            "id": endpoint_id,
            "source": "registered",
            **changes,
            "revision": revision,
        }

    def edit(stored: StoredObject | None) -> dict[str, Any]:
        if stored is None:
            raise ApiError(
                404,
                f"endpoint {endpoint_id!r} is not registered and pool {pool!r} does not exist",
            )
        try:
            pool_obj = parse_for_kind(stored.body, "Pool")
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
                            e.model_copy(update=changes) if e.key == endpoint_id else e
                            for e in endpoints
                        ]
                    }
                )
            }
        )
        return dump(updated)

    written = await store.update("Pool", pool, edit, attempts=WEIGHT_CAS_ATTEMPTS, actor=actor)
    log.info("pool %s static endpoint %s %s", pool, endpoint_id, what)
    return {
        "pool": pool,
        "id": endpoint_id,
        "source": "static",
        **changes,
        "revision": written.revision,
    }
