"""Bearer-token authentication for the REST API, with two roles: ``read`` and ``admin``.

Tokens come from a tokens file (YAML or JSON, ``{tokens: [{name, role, token}]}``) and/or the
environment (``KVPILOT_ADMIN_TOKEN``, ``KVPILOT_READ_TOKEN``). Reads need ``read`` or ``admin``;
every write needs ``admin``. Authentication is off only through ``AuthConfig.disabled()`` (the
daemon's ``--insecure-no-auth``). Token values never appear in logs, errors or ``repr``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
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

    def __init__(self, tokens: Iterable[tuple[str, Role, str]], *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._tokens: list[_Token] = []
        seen: dict[bytes, str] = {}
        for name, role, token in tokens:
            digest = _digest(token)
            if digest in seen:
                raise AuthConfigError(
                    f"API tokens {seen[digest]!r} and {name!r} have the same value; "
                    "give every token its own value"
                )
            seen[digest] = name
            self._tokens.append(_Token(name, role, digest))
        if enabled and not self._tokens:
            raise AuthConfigError(
                f"no API tokens are configured: set {ENV_ADMIN_TOKEN} (and optionally "
                f"{ENV_READ_TOKEN}), pass --tokens-file, or run with --insecure-no-auth"
            )

    @classmethod
    def disabled(cls) -> AuthConfig:
        """No authentication at all: every request acts as admin. For local use only."""
        return cls([], enabled=False)

    @classmethod
    def from_sources(cls, tokens_file: Path | None, env: Mapping[str, str]) -> AuthConfig:
        """Tokens from ``tokens_file`` (if given) plus the ``KVPILOT_*_TOKEN`` variables."""
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
        return cls(tokens)

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


_bearer = HTTPBearer(
    auto_error=False,
    description="A kvpilot API token: role read for GET, role admin for every write.",
)


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    """A FastAPI dependency that admits principals allowed to act as ``role``.

    No or unknown token: 401 with ``WWW-Authenticate: Bearer``. A known token whose role is too
    weak: 403. The ``AuthConfig`` is read from ``request.app.state.auth``.
    """

    async def dependency(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        config: AuthConfig = request.app.state.auth
        principal = config.authenticate(credentials.credentials if credentials else None)
        if principal is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "a valid API token is required: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not principal.allows(role):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"token {principal.name!r} has role {principal.role!r}; this request needs "
                f"role {role!r}",
            )
        return principal

    dependency.__name__ = f"require_{role}"
    return dependency
