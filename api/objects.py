"""CRUD on policy objects, one set of routes per kind, with revisions as ETags.

Every object lives in etcd under its kind and name; its etcd ``mod_revision`` is its ETag, and
writes that carry ``If-Match`` fail with 412 instead of silently overwriting someone else's
change. Bodies are validated with ``policies.parse_object`` before anything is written: an
invalid body gets 422 with the field path of every problem, and etcd is left untouched. With
``dryRun`` a change is validated and previewed (the Envoy resources it would produce) instead.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from api.context import (
    Admin,
    ApiContext,
    ApiError,
    ObjectName,
    Reader,
    dump,
    etag,
    json_body,
    parse_for_kind,
    read,
)
from compiler.rollout import reference_errors
from controlplane.decode import DecodedState
from controlplane.etcd.keys import ENDPOINTS, OBJECTS
from controlplane.etcd.store import Actor, Store, StoredObject
from policies import FieldError, PolicyError, PolicyObject, Rollout, parse_object
from xdsserver.render import render, resource_changes

log = logging.getLogger(__name__)


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


def _parse_if_match(value: str | None) -> int | str | None:
    """``"42"``, ``W/"42"`` or ``42`` -> 42; ``*`` -> "*"; absent -> None."""
    if value is None:
        return None
    text = value.strip()
    if text == "*":
        return "*"
    text = text.removeprefix("W/").strip('"')
    # etcd revisions are int64: a longer number is no ETag kvpilot ever sent.
    if not text.isdigit() or len(text) > 19 or int(text) >= 2**63:
        raise ApiError(
            400,
            f"If-Match {value!r} is not a kvpilot ETag: send the ETag header of a GET, "
            'for example If-Match: "42"',
        )
    return int(text)


def _object_response(stored: StoredObject, status: int = 200) -> JSONResponse:
    return JSONResponse(stored.body, status_code=status, headers={"ETag": etag(stored.revision)})


async def _check_references(store: Store, obj: PolicyObject) -> None:
    """A Rollout must name a policy, route, tier and pools that exist (422 otherwise); other
    kinds may refer to objects created later, and compile reports what is missing."""
    if not isinstance(obj, Rollout):
        return
    state = DecodedState.from_values(await store.values((OBJECTS,)))
    state.objects[store.keys.object(obj.kind, obj.metadata.name)] = obj
    errors = reference_errors(obj, state.policy_state())
    if errors:
        raise PolicyError(errors)


async def _dry_run(
    store: Store, kind: str, name: str, replacement: PolicyObject | None
) -> dict[str, Any]:
    """The resources every fleet would get with `replacement` (None: a deletion) in place of
    the object, over the valid objects and registered endpoints in etcd now, decoded as the
    daemon decodes them."""
    state = DecodedState.from_values(await store.values((OBJECTS, ENDPOINTS)))
    key = store.keys.object(kind, name)
    if replacement is None:
        state.objects.pop(key, None)
    else:
        state.objects[key] = replacement
    return {"dryRun": True, **render(state.policy_state())}


def add_preview_route(app: FastAPI, context: ApiContext) -> None:
    """``POST /v1/preview``: what applying a set of objects would change, in Envoy terms."""
    store = context.store

    @app.post(
        "/v1/preview",
        tags=["status"],
        operation_id="preview",
        summary="What applying these objects would change in the Envoy resources of every "
        "fleet (nothing is written)",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {"objects": {"type": "array", "items": {}}},
                        }
                    }
                },
            }
        },
    )
    async def preview_apply(request: Request, _: Reader) -> dict[str, Any]:
        data = await json_body(request)
        items = data.get("objects") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ApiError(400, 'send {"objects": [...]}: the objects you would apply')
        errors: list[FieldError] = []
        proposed: list[PolicyObject] = []
        for index, item in enumerate(items):
            try:
                proposed.append(parse_object(item))
            except PolicyError as error:
                errors.extend(
                    FieldError(f"objects[{index}].{e.path}".rstrip("."), e.message)
                    for e in error.errors
                )
        if errors:
            raise PolicyError(errors)
        state = DecodedState.from_values(await store.values((OBJECTS, ENDPOINTS)))
        before = render(state.policy_state())
        outcomes = []
        for obj in proposed:
            key = store.keys.object(obj.kind, obj.metadata.name)
            current = state.objects.get(key)
            outcome = (
                "created"
                if current is None
                else "unchanged"
                if dump(current) == dump(obj)
                else "configured"
            )
            outcomes.append({"kind": obj.kind, "name": obj.metadata.name, "outcome": outcome})
            state.objects[key] = obj
        after = render(state.policy_state())
        return {
            "objects": outcomes,
            "diagnostics": after["diagnostics"],
            "changes": resource_changes(before["fleets"], after["fleets"]),
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


def add_object_routes(app: FastAPI, context: ApiContext, kind: str, path: str) -> None:
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

    async def list_objects(_: Reader) -> JSONResponse:
        (objects, revision), headers = await read(
            context,
            lambda: store.list(kind),
            lambda items: (store.list_from(items, kind), context.mirror.revision),  # type: ignore[union-attr]
        )
        return JSONResponse(
            {"items": [obj.body for obj in objects], "revision": revision}, headers=headers
        )

    async def get_object(name: ObjectName, _: Reader) -> JSONResponse:
        stored, headers = await read(
            context,
            lambda: store.get(kind, name),
            lambda items: store.get_from(items, kind, name),
        )
        if stored is None:
            raise ApiError(404, f"{kind} {name!r} does not exist", headers)
        response = _object_response(stored)
        response.headers.update(headers)
        return response

    async def create_object(
        request: Request, principal: Admin, dry_run: DryRun = False
    ) -> JSONResponse:
        obj = parse_for_kind(await json_body(request), kind)
        await _check_references(store, obj)
        name = obj.metadata.name
        if dry_run:
            if await store.get(kind, name) is not None:
                raise ApiError(409, f"{kind} {name!r} already exists; PUT replaces it")
            return JSONResponse(await _dry_run(store, kind, name, obj))
        stored = await store.create(
            kind, name, dump(obj), actor=Actor(principal.name, f"create_{path}")
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
        obj = parse_for_kind(await json_body(request), kind)
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
        await _check_references(store, obj)
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
            dump(obj),
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

    def route(at: str, endpoint: Any, method: str, verb: str, summary: str, **extra: Any) -> None:
        app.add_api_route(
            at,
            endpoint,
            methods=[method],
            tags=tags,
            operation_id=f"{verb}_{path}",
            summary=summary,
            **extra,
        )

    one = f"{base}/{{name}}"
    missing = {404: {"description": "No such object."}}
    stale = {412: {"description": "If-Match failed."}}
    invalid = {422: {"description": "Invalid body."}}
    route(base, list_objects, "GET", "list", f"List {kind} objects")
    route(one, get_object, "GET", "get", f"Read one {kind} (ETag: its revision)", responses=missing)
    route(
        base,
        create_object,
        "POST",
        "create",
        f"Create a {kind}",
        status_code=201,
        openapi_extra=body_doc,
        responses={409: {"description": "It exists."}, **invalid},
    )
    route(
        one,
        replace_object,
        "PUT",
        "replace",
        f"Create or replace a {kind}",
        openapi_extra=body_doc,
        responses={**stale, **invalid},
    )
    route(
        one,
        delete_object,
        "DELETE",
        "delete",
        f"Delete a {kind}",
        status_code=204,
        responses={**missing, **stale},
    )
