"""What every route of the REST API works with: the context the daemon builds, the error
answered as ``{"detail": ...}``, the role a route requires, and reading and writing bodies."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import prometheus_client
from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from api.auth import AuthConfig, Principal, WriteRateLimit, require
from controlplane.audit import AuditLog
from controlplane.reconcile import Reconciler
from controlplane.store import Store
from policies import Endpoint, FieldError, PolicyError, PolicyObject, parse_object
from xdsserver.status import ConnectionRegistry

Reader = Annotated[Principal, Depends(require("read"))]
Admin = Annotated[Principal, Depends(require("admin"))]


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
    audit: AuditLog | None = None
    """Where /v1/audit reads from; the store's ``on_write`` writes to it."""
    write_limit: WriteRateLimit | None = None
    """Per-token write rate limit; None: unlimited."""
    cors_origins: Sequence[str] = ()
    """Browser origins allowed to call the API; empty: CORS stays closed."""


class ApiError(Exception):
    """An error answered with ``{"detail": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def etag(revision: int) -> str:
    return f'"{revision}"'


def _validation_detail(errors: list[FieldError]) -> list[dict[str, str]]:
    return [{"loc": error.path, "msg": error.message} for error in errors]


def unprocessable(errors: list[FieldError]) -> JSONResponse:
    return JSONResponse({"detail": _validation_detail(errors)}, status_code=422)


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and they cannot be written back.
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range for a number")
    return value


async def json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "the request needs a JSON body")
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


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
