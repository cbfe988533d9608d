"""Bearer-token authentication for the REST API, with two roles: ``read`` and ``admin``.

Tokens come from a tokens file (YAML or JSON, ``{tokens: [{name, role, token}]}``) and/or the
environment (``KVPILOT_ADMIN_TOKEN``, ``KVPILOT_READ_TOKEN``). Reads need ``read`` or ``admin``;
every write needs ``admin``. Authentication is off only through ``AuthConfig.disabled()`` (the
daemon's ``--insecure-no-auth``). Token values never appear in logs, errors or ``repr``.

``TokenReloader`` re-reads the tokens file when it changes (or on SIGHUP): a removed token stops
working and an added one starts without a restart; a broken file keeps the tokens in force.
``WriteRateLimit`` gives each token its own bucket of writes, so one runaway script cannot
flood etcd and every Envoy with changes. Writes refused for either reason are counted.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

Role = Literal["read", "admin"]
ROLES: tuple[Role, ...] = ("read", "admin")

ENV_ADMIN_TOKEN = "KVPILOT_ADMIN_TOKEN"
ENV_READ_TOKEN = "KVPILOT_READ_TOKEN"


class AuthConfigError(ValueError):
    """The token configuration cannot be used; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a request: the token's name and role (never the token itself)."""

    name: str
    role: Role

    def allows(self, needed: Role) -> bool:
        """``admin`` may do everything; ``read`` only reads."""
        return self.role == "admin" or needed == "read"


@dataclass(frozen=True, slots=True)
class _Token:
    name: str
    role: Role
    digest: bytes = field(repr=False)


class _TokenEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    role: Role
    token: str = Field(min_length=1, repr=False)


class _TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[_TokenEntry]


def _digest(token: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison constant-time even when the
    # presented token's length differs from the stored one's.
    return hashlib.sha256(token.encode()).digest()


class AuthConfig:
    """The accepted tokens, or the explicit decision to accept everyone."""

    def __init__(
        self,
        tokens: Iterable[tuple[str, Role, str]],
        *,
        enabled: bool = True,
        allow_empty: bool = False,
    ) -> None:
        self.enabled = enabled
        self._tokens: tuple[_Token, ...] = ()
        loaded: list[_Token] = []
        seen: dict[bytes, str] = {}
        for name, role, token in tokens:
            digest = _digest(token)
            if digest in seen:
                raise AuthConfigError(
                    f"API tokens {seen[digest]!r} and {name!r} have the same value; "
                    "give every token its own value"
                )
            seen[digest] = name
            loaded.append(_Token(name, role, digest))
        self._tokens = tuple(loaded)
        if enabled and not self._tokens and not allow_empty:
            raise AuthConfigError(
                f"no API tokens are configured: set {ENV_ADMIN_TOKEN} (and optionally "
                f"{ENV_READ_TOKEN}), pass --tokens-file, or run with --insecure-no-auth"
            )

    @classmethod
    def disabled(cls) -> AuthConfig:
        """No authentication at all: every request acts as admin. For local use only."""
        return cls([], enabled=False)

    @classmethod
    def from_sources(
        cls, tokens_file: Path | None, env: Mapping[str, str], *, allow_empty: bool = False
    ) -> AuthConfig:
        """Tokens from ``tokens_file`` (if given) plus the ``KVPILOT_*_TOKEN`` variables.
        ``allow_empty``: no token at all is a valid set (a reload that revokes the last one)."""
        tokens: list[tuple[str, Role, str]] = []
        if tokens_file is not None:
            tokens.extend(_read_tokens_file(tokens_file))
        env_roles: tuple[tuple[str, Role], ...] = (
            (ENV_ADMIN_TOKEN, "admin"),
            (ENV_READ_TOKEN, "read"),
        )
        for variable, role in env_roles:
            value = env.get(variable, "").strip()
            if value:
                tokens.append((variable.lower(), role, value))
        return cls(tokens, allow_empty=allow_empty)

    def adopt(self, other: AuthConfig) -> None:
        """Take ``other``'s tokens (one assignment: a request sees the old set or the new)."""
        self._tokens = other._tokens

    @property
    def names(self) -> list[str]:
        """The names of the accepted tokens (for logs; never their values)."""
        return [t.name for t in self._tokens]

    def __repr__(self) -> str:
        names = ", ".join(f"{t.name}:{t.role}" for t in self._tokens)
        return f"AuthConfig(enabled={self.enabled}, tokens=[{names}])"

    def authenticate(self, token: str | None) -> Principal | None:
        """The principal holding ``token``, or None. Every stored token is compared, in
        constant time, so the time taken says nothing about which one nearly matched."""
        if not self.enabled:
            return Principal("anonymous", "admin")
        if not token:
            return None
        digest = _digest(token)
        found: _Token | None = None
        for candidate in self._tokens:
            if hmac.compare_digest(candidate.digest, digest):
                found = candidate
        return Principal(found.name, found.role) if found is not None else None


def _read_tokens_file(path: Path) -> list[tuple[str, Role, str]]:
    try:
        text = path.read_text()
    except OSError as error:
        raise AuthConfigError(f"cannot read the tokens file {path}: {error.strerror}") from None
    try:
        data = json.loads(text) if text.lstrip().startswith("{") else yaml.safe_load(text)
        parsed = _TokensFile.model_validate(data)
    except (ValueError, yaml.YAMLError) as error:
        # Never echo the file's content: it holds secrets.
        if isinstance(error, ValidationError):
            where = "; ".join(
                ".".join(str(part) for part in item["loc"]) + ": " + item["msg"]
                for item in error.errors(include_input=False)
            )
        else:
            where = "it is not valid YAML or JSON"
        raise AuthConfigError(
            f"the tokens file {path} is invalid ({where}); expected "
            "{tokens: [{name: ..., role: read|admin, token: ...}]}"
        ) from None
    return [(entry.name, entry.role, entry.token) for entry in parsed.tokens]


class TokenReloader:
    """Keeps an ``AuthConfig`` in step with its tokens file.

    ``watch()`` polls the file's identity (inode, size, mtime, through symlinks, so a Kubernetes
    Secret's ``..data`` swap counts) every ``interval`` seconds; ``reload()`` is what SIGHUP
    calls. A file that no longer parses is logged, without its content, and the tokens in
    force stay.
    """

    def __init__(
        self,
        config: AuthConfig,
        tokens_file: Path,
        env: Mapping[str, str],
        *,
        interval: float = 0.5,
    ) -> None:
        self.config = config
        self.tokens_file = tokens_file
        self.env = dict(env)
        self.interval = interval
        self._stamp = self._file_stamp()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.tokens_file)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def reload(self) -> bool:
        """Re-read the tokens file now; True if the new tokens are in force."""
        self._stamp = self._file_stamp()
        try:
            fresh = AuthConfig.from_sources(self.tokens_file, self.env, allow_empty=True)
        except AuthConfigError as error:
            log.error("API tokens not reloaded, the previous tokens stay in force: %s", error)
            return False
        before = set(self.config.names)
        self.config.adopt(fresh)
        after = set(self.config.names)
        log.info(
            "API tokens reloaded from %s: %d tokens (added %s; removed %s)",
            self.tokens_file,
            len(after),
            ", ".join(sorted(after - before)) or "none",
            ", ".join(sorted(before - after)) or "none",
        )
        return True

    async def watch(self) -> None:
        """Reload whenever the file changes, until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            if self._file_stamp() != self._stamp:
                self.reload()


class WriteRateLimit:
    """A token bucket per API token name: ``rate`` writes a second, bursts up to ``burst``."""

    def __init__(
        self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a write rate limit needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}

    def acquire(self, name: str) -> float:
        """Take one write for ``name``: 0 if allowed, else seconds until one is."""
        now = self._clock()
        tokens, last = self._buckets.get(name, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self._buckets[name] = (tokens - 1.0, now)
            return 0.0
        self._buckets[name] = (tokens, now)
        return (1.0 - tokens) / self.rate


class AuthMetrics:
    """Writes the API refused before they reached etcd, by reason."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.writes_refused = Counter(
            "kvpilot_api_writes_refused_total",
            "REST writes refused before reaching etcd: unauthenticated (no or unknown token), "
            "forbidden (role too weak) or rate_limited (the token's write rate limit).",
            ["reason"],
            registry=registry if registry is not None else REGISTRY,
        )


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


_bearer = HTTPBearer(
    auto_error=False,
    description="A kvpilot API token: role read for GET, role admin for every write.",
)


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    """A FastAPI dependency that admits principals allowed to act as ``role``.

    No or unknown token: 401 with ``WWW-Authenticate: Bearer``. A known token whose role is too
    weak: 403. A write over the token's rate limit: 429 with ``Retry-After``. The
    ``AuthConfig`` is read from ``request.app.state.auth``, the optional ``WriteRateLimit``
    from ``request.app.state.write_limit`` and ``AuthMetrics`` from
    ``request.app.state.auth_metrics``.
    """

    async def dependency(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        config: AuthConfig = request.app.state.auth
        write = request.method not in _SAFE_METHODS
        metrics: AuthMetrics | None = getattr(request.app.state, "auth_metrics", None)

        def refused(reason: str) -> None:
            if write and metrics is not None:
                metrics.writes_refused.labels(reason=reason).inc()

        principal = config.authenticate(credentials.credentials if credentials else None)
        if principal is None:
            refused("unauthenticated")
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "a valid API token is required: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not principal.allows(role):
            refused("forbidden")
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"token {principal.name!r} has role {principal.role!r}; this request needs "
                f"role {role!r}",
            )
        limit: WriteRateLimit | None = getattr(request.app.state, "write_limit", None)
        if write and limit is not None:
            wait = limit.acquire(principal.name)
            if wait > 0:
                refused("rate_limited")
                raise HTTPException(
                    status.HTTP_429_TOO_MANY_REQUESTS,
                    f"token {principal.name!r} is over its write rate limit "
                    f"({limit.rate:g}/s, bursts of {limit.burst}); retry in {wait:.1f}s",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )
        return principal

    dependency.__name__ = f"require_{role}"
    return dependency
