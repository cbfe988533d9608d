"""What every route of the REST API works with: the context the daemon builds, the error
answered as ``{"detail": ...}``, the role a route requires, and reading and writing bodies.

Whatever a client sends gets a 4xx, never a 5xx: every body goes through one reader
(`json_body`: at most `MAX_BODY_BYTES`, JSON parsed by `policies.jsondoc`), and every path
parameter through one rule (the `ObjectName`, `PoolName`, `EndpointId` and `FleetName` types:
the rules of ``metadata.name``). A 5xx means etcd (or kvpilot) is broken, and says which."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import prometheus_client
from fastapi import Depends, Path, Request
from fastapi.responses import JSONResponse

from api.auth import AuthConfig, Principal, WriteRateLimit, require
from controlplane.audit import AuditLog
from controlplane.etcd import EtcdOutcomeUnknown, EtcdUnavailable, KeyValue
from controlplane.etcd.store import Store
from controlplane.mirror import StateMirror
from controlplane.reconcile.loop import Reconciler
from policies import Endpoint, FieldError, PolicyError, PolicyObject, jsondoc, parse_object
from policies.models import ENDPOINT_ID_PATTERN, ENDPOINT_ID_RULE, NAME_PATTERN, NAME_RULE
from signals.spend import Spend, SpendKey, Window
from xdsserver.difficultylog import VirtualModelCounts
from xdsserver.status import ConnectionRegistry

log = logging.getLogger(__name__)

T = TypeVar("T")

Reader = Annotated[Principal, Depends(require("read"))]
Admin = Annotated[Principal, Depends(require("admin"))]

MAX_BODY_BYTES = 1024 * 1024
"""Largest request body read, in bytes. etcd refuses values over its --max-request-bytes
(1.5 MiB by default), and a body is stored with its defaults filled in."""

ObjectName = Annotated[
    str, Path(pattern=NAME_PATTERN, max_length=63, description=f"Object name: {NAME_RULE}.")
]
PoolName = Annotated[
    str, Path(pattern=NAME_PATTERN, max_length=63, description=f"Pool name: {NAME_RULE}.")
]
FleetName = Annotated[
    str, Path(pattern=NAME_PATTERN, max_length=63, description=f"Fleet name: {NAME_RULE}.")
]
EndpointId = Annotated[
    str,
    Path(
        pattern=ENDPOINT_ID_PATTERN,
        max_length=260,
        description=f"Endpoint id: {ENDPOINT_ID_RULE}.",
    ),
]
PATH_RULES = {
    "name": NAME_RULE,
    "pool": NAME_RULE,
    "fleet": NAME_RULE,
    "endpoint_id": ENDPOINT_ID_RULE,
}
"""The rule each path parameter follows, in words, for the 422 that breaks it."""


@dataclass
class ApiContext:
    """What the API works on; the daemon builds it, tests build their own."""

    store: Store
    reconciler: Reconciler
    connections: ConnectionRegistry
    auth: AuthConfig
    metrics_registry: prometheus_client.CollectorRegistry | None = None
    replica_id: str = ""
    """This kvpilot replica's id, as its Envoy status records in etcd carry it."""
    envoy_records: Callable[[], list[dict[str, Any]]] | None = None
    """The Envoy status records every replica publishes to etcd
    (`controlplane.envoystatus`): with them /v1/status lists the Envoys of all replicas."""
    mirror: StateMirror | None = None
    """The daemon's watched copy of etcd: reads are answered from it, marked stale, while etcd
    cannot be reached."""
    etcd_embedded: bool = False
    """True when `kvpilot serve` started its own etcd (no --etcd-endpoints)."""
    etcd_watching: Callable[[], bool] | None = None
    """Whether the daemon's etcd watch is established now."""
    audit: AuditLog | None = None
    """Where /v1/audit reads from; the store's ``on_write`` writes to it."""
    write_limit: WriteRateLimit | None = None
    """Per-token write rate limit; None: unlimited."""
    cors_origins: Sequence[str] = ()
    """Browser origins allowed to call the API; empty: CORS stays closed."""
    virtual_model_counts: Callable[[], Mapping[str, VirtualModelCounts]] | None = None
    """What Envoys reported about virtual models' requests to this replica (the console)."""
    spend: Callable[[Window | None, float], Mapping[SpendKey, Spend]] | None = None
    """Every replica's spend summed (``controlplane.spend.fleet_spend``): all time (None) or
    the current calendar window of a kind, at a time."""


class ApiError(Exception):
    """An error answered with ``{"detail": message}``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


def etag(revision: int) -> str:
    return f'"{revision}"'


def _validation_detail(errors: list[FieldError]) -> list[dict[str, str]]:
    return [{"loc": error.path, "msg": error.message} for error in errors]


def unprocessable(errors: list[FieldError]) -> JSONResponse:
    return JSONResponse({"detail": _validation_detail(errors)}, status_code=422)


def _too_large() -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than {MAX_BODY_BYTES:,} bytes, the most kvpilot accepts; "
        "split the object (a pool per model, say) or register endpoints one by one",
    )


async def json_body(request: Request) -> Any:
    """The request's JSON body: every route reads bodies here and only here."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request needs a JSON body")
    try:
        return jsondoc.loads(raw)
    except jsondoc.JsonError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


async def read(
    context: ApiContext,
    from_etcd: Callable[[], Awaitable[T]],
    from_mirror: Callable[[Mapping[str, KeyValue]], T],
) -> tuple[T, dict[str, str]]:
    """A read from etcd; while etcd cannot be reached, from the mirror with headers that say
    so (`X-Kvpilot-Stale`, the mirror's revision, and `Age`: seconds since its watch broke).
    Without a loaded mirror, etcd's error stands."""
    mirror = context.mirror
    if mirror is None or not mirror.synced:
        return await from_etcd(), {}
    if not mirror.lost:  # otherwise etcd is known down: do not wait out its timeout
        try:
            return await from_etcd(), {}
        except EtcdOutcomeUnknown:
            raise
        except EtcdUnavailable as error:
            log.warning("etcd unreachable, answering a read from the mirror: %s", error)
    headers = {
        "X-Kvpilot-Stale": "true",
        "X-Kvpilot-Mirror-Revision": str(mirror.revision),
        "Age": str(int(mirror.age)),
    }
    return from_mirror(mirror.items), headers


def parse_for_kind(data: Any, kind: str) -> PolicyObject:
    """Validate ``data`` as a ``kind`` object; ``kind`` may be left out of the body."""
    if isinstance(data, dict) and "kind" not in data:
        data = {**data, "kind": kind}
    obj = parse_object(data)
    if obj.kind != kind:
        raise PolicyError([FieldError("kind", f"this path takes {kind} objects, not {obj.kind}")])
    return obj


def dump(obj: PolicyObject | Endpoint) -> dict[str, Any]:
    return obj.model_dump(mode="json", by_alias=True)
