"""Endpoint registration (optionally under a lease) and weight changes, for registered and
static endpoints alike."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.context import Admin, ApiContext, ApiError, Reader, dump, etag, json_body, parse_for_kind
from controlplane.etcd import LeaseNotFoundError
from controlplane.store import Actor, StoredObject
from policies import Endpoint, PolicyError, Pool
from policies.validate import field_errors

log = logging.getLogger(__name__)


WEIGHT_CAS_ATTEMPTS = 10
"""Compare-and-swap attempts when a weight change rewrites a Pool that others also edit."""


class WeightChange(BaseModel):
    """A new load-balancing weight for one endpoint."""

    model_config = ConfigDict(extra="forbid")

    weight: int = Field(ge=1, le=10_000, description="Relative weight within the pool, 1-10000.")


def add_endpoint_routes(app: FastAPI, context: ApiContext) -> None:
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
        registrations, revision = await store.endpoints(pool)
        items = [
            {
                "id": registration.endpoint_id,
                "endpoint": registration.body,
                "revision": registration.revision,
                "lease": registration.lease or None,
                "ttlSeconds": await store.lease_ttl(registration.lease),
            }
            for registration in registrations
        ]
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
            endpoint = Endpoint.model_validate(await json_body(request))
        except ValidationError as error:
            raise PolicyError(field_errors(error)) from None
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
        registration = await store.get_endpoint(pool, endpoint_id)
        if registration is not None:
            current = registration.body
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
                    pool, endpoint_id, dump(endpoint), lease=registration.lease or None, actor=actor
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

        def reweigh(stored: StoredObject | None) -> dict[str, Any]:
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
                                e.model_copy(update={"weight": change.weight})
                                if e.key == endpoint_id
                                else e
                                for e in endpoints
                            ]
                        }
                    )
                }
            )
            return dump(updated)

        written = await store.update(
            "Pool", pool, reweigh, attempts=WEIGHT_CAS_ATTEMPTS, actor=actor
        )
        log.info("pool %s static endpoint %s weight -> %d", pool, endpoint_id, change.weight)
        return {
            "pool": pool,
            "id": endpoint_id,
            "source": "static",
            "weight": change.weight,
            "revision": written.revision,
        }
