"""A small typed client for kvpilot's REST API, used by the CLI and the demo."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from policies import KIND_PATHS, KINDS, PolicyError, kind_named, parse_object

DEFAULT_SERVER = "http://127.0.0.1:8080"

Outcome = Literal["created", "configured", "unchanged"]


@dataclass(frozen=True)
class Applied:
    """What `KvpilotClient.apply` did, and the object's revision afterwards."""

    outcome: Outcome
    revision: int | None


class ClientError(Exception):
    """A request failed; ``str()`` is one sentence for the user."""

    def __init__(self, message: str, *, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


def kind_name(kind: str) -> str:
    """``pool``, ``pools``, ``Pool`` -> ``Pool``; also ``rp``/``policy`` for RoutingPolicy."""
    found = kind_named(kind)
    if found is None:
        known = ", ".join(sorted({k.lower() for k in KIND_PATHS} | set(KIND_PATHS.values())))
        raise ClientError(f"unknown kind {kind!r}; use one of {known}")
    return found


def _revision(response: httpx.Response) -> int | None:
    etag = response.headers.get("etag", "").strip('"')
    return int(etag) if etag.isdigit() else None


def _message(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, list):
        parts = [
            f"{item.get('loc')}: {item.get('msg')}" if item.get("loc") else str(item.get("msg"))
            for item in detail
            if isinstance(item, dict)
        ]
        return "; ".join(parts) or "invalid request"
    if isinstance(detail, str):
        return detail
    return f"{response.status_code} {response.reason_phrase}"


class KvpilotClient:
    """Synchronous client; ``transport`` lets tests talk to an app without a socket."""

    def __init__(
        self,
        server: str = DEFAULT_SERVER,
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.server = server.rstrip("/")
        self._http = httpx.Client(
            base_url=self.server, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> KvpilotClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------------

    def _request(
        self, method: str, url: str, *, ok: tuple[int, ...] = (200,), **kwargs: Any
    ) -> httpx.Response:
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.TransportError as error:
            raise ClientError(
                f"cannot reach kvpilot at {self.server}: {error or type(error).__name__}; "
                "is `kvpilot serve` running, and is --server (KVPILOT_SERVER) right?"
            ) from None
        if response.status_code not in ok:
            raise ClientError(
                _message(response), status=response.status_code, detail=_detail(response)
            )
        return response

    @staticmethod
    def _path(kind: str, name: str | None = None) -> str:
        base = f"/v1/{KIND_PATHS[kind_name(kind)]}"
        return f"{base}/{name}" if name is not None else base

    # -- objects -----------------------------------------------------------------------------

    def list_objects(self, kind: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._request("GET", self._path(kind)).json()["items"]
        return items

    def get(self, kind: str, name: str) -> dict[str, Any]:
        """The object as stored; ``ClientError`` (status 404) if it does not exist."""
        body, _ = self.get_with_revision(kind, name)
        return body

    def get_with_revision(self, kind: str, name: str) -> tuple[dict[str, Any], int | None]:
        response = self._request("GET", self._path(kind, name))
        body: dict[str, Any] = response.json()
        return body, _revision(response)

    def put(
        self, body: Mapping[str, Any], *, revision: int | None = None, dry_run: bool = False
    ) -> dict[str, Any]:
        """Create or replace; with ``revision``, only if the object is still at it."""
        result, _ = self._put(body, revision=revision, dry_run=dry_run)
        return result

    def _put(
        self, body: Mapping[str, Any], *, revision: int | None = None, dry_run: bool = False
    ) -> tuple[dict[str, Any], int | None]:
        kind, name = _identity(body)
        headers = {"If-Match": f'"{revision}"'} if revision is not None else {}
        params = {"dryRun": "true"} if dry_run else {}
        response = self._request(
            "PUT",
            self._path(kind, name),
            ok=(200, 201),
            json=dict(body),
            headers=headers,
            params=params,
        )
        result: dict[str, Any] = response.json()
        return result, _revision(response)

    def apply(self, body: Mapping[str, Any]) -> Applied:
        """Make the stored object equal ``body``: created, configured (changed) or unchanged."""
        kind, name = _identity(body)
        try:
            current, revision = self.get_with_revision(kind, name)
        except ClientError as error:
            if error.status != 404:
                raise
            _, written = self._put(body)
            return Applied("created", written)
        if _normalized(body) == current:
            return Applied("unchanged", revision)
        _, written = self._put(body, revision=revision)
        return Applied("configured", written)

    def preview(self, objects: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """What applying ``objects`` would change in every fleet's Envoy resources."""
        result: dict[str, Any] = self._request(
            "POST", "/v1/preview", json={"objects": [dict(obj) for obj in objects]}
        ).json()
        return result

    def delete(self, kind: str, name: str, *, revision: int | None = None) -> None:
        headers = {"If-Match": f'"{revision}"'} if revision is not None else {}
        self._request("DELETE", self._path(kind, name), ok=(204,), headers=headers)

    # -- endpoints ---------------------------------------------------------------------------

    def endpoints(self, pool: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._request("GET", f"/v1/pools/{pool}/endpoints").json()[
            "items"
        ]
        return items

    def register_endpoint(
        self, pool: str, endpoint_id: str, endpoint: Mapping[str, Any], *, ttl: int | None = None
    ) -> dict[str, Any]:
        params = {"ttl": ttl} if ttl is not None else {}
        result: dict[str, Any] = self._request(
            "PUT", f"/v1/pools/{pool}/endpoints/{endpoint_id}", json=dict(endpoint), params=params
        ).json()
        return result

    def deregister_endpoint(self, pool: str, endpoint_id: str) -> None:
        self._request("DELETE", f"/v1/pools/{pool}/endpoints/{endpoint_id}", ok=(204,))

    def set_weight(self, pool: str, endpoint_id: str, weight: int) -> dict[str, Any]:
        """Change one endpoint's weight: a registered id, or a static ``address:port``."""
        result: dict[str, Any] = self._request(
            "PUT", f"/v1/pools/{pool}/endpoints/{endpoint_id}/weight", json={"weight": weight}
        ).json()
        return result

    def set_health(self, pool: str, endpoint_id: str, health: str) -> dict[str, Any]:
        """Change one endpoint's health as Envoy gets it over EDS (``draining`` drains it)."""
        result: dict[str, Any] = self._request(
            "PUT", f"/v1/pools/{pool}/endpoints/{endpoint_id}/health", json={"health": health}
        ).json()
        return result

    # -- rollouts ----------------------------------------------------------------------------

    def rollout_status(self, name: str) -> dict[str, Any]:
        """A rollout's phase, step, weights, live verdict and history."""
        result: dict[str, Any] = self._request("GET", f"/v1/rollouts/{name}/status").json()
        return result

    def rollout_command(self, name: str, command: str) -> dict[str, Any]:
        """Ask the driving replica to pause, resume, abort or promote a rollout."""
        result: dict[str, Any] = self._request(
            "POST", f"/v1/rollouts/{name}/{command}", ok=(202,)
        ).json()
        return result

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/v1/status").json()
        return result

    def endpoints_view(self) -> dict[str, Any]:
        """Every pool's endpoints with effective weight, health and telemetry."""
        result: dict[str, Any] = self._request("GET", "/v1/endpoints").json()
        return result

    def spend(self, window: str = "total", by: str = "tenant,model,pool") -> dict[str, Any]:
        """Tokens and cost summed over every replica (``GET /v1/spend``)."""
        result: dict[str, Any] = self._request(
            "GET", "/v1/spend", params={"window": window, "by": by}
        ).json()
        return result

    def audit(self, limit: int = 100) -> list[dict[str, Any]]:
        """The newest audit entries, newest first."""
        items: list[dict[str, Any]] = self._request(
            "GET", "/v1/audit", params={"limit": limit}
        ).json()["items"]
        return items

    def fleet_config(self, fleet: str) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", f"/v1/fleets/{fleet}/config").json()
        return result


def _detail(response: httpx.Response) -> Any:
    try:
        return response.json().get("detail")
    except (ValueError, AttributeError):
        return None


def _identity(body: Mapping[str, Any]) -> tuple[str, str]:
    kind = body.get("kind")
    metadata = body.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(kind, str) or kind not in KINDS or not isinstance(name, str):
        raise ClientError("an object needs a known kind and metadata.name")
    return kind, name


def _normalized(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The body as the server would store it (defaults filled), or None if it is invalid."""
    try:
        return parse_object(dict(body)).model_dump(mode="json", by_alias=True)
    except PolicyError:
        return None
