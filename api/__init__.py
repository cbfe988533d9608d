"""The REST API over the store: CRUD with revisions, bearer-token auth, status endpoints.

The names below load on first use (PEP 562), so `api.client`, which the CLI and the demo
import, does not pay for importing FastAPI and the whole app.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api.app import create_app
    from api.auth import AuthConfig, AuthConfigError, Principal, Role
    from api.context import ApiContext

__all__ = ["ApiContext", "AuthConfig", "AuthConfigError", "Principal", "Role", "create_app"]

_HOMES = {
    "create_app": "api.app",
    "AuthConfig": "api.auth",
    "AuthConfigError": "api.auth",
    "Principal": "api.auth",
    "Role": "api.auth",
    "ApiContext": "api.context",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'api' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
