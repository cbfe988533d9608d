"""The REST API over the store: CRUD with revisions, bearer-token auth, status endpoints."""

from api.app import create_app
from api.auth import AuthConfig, AuthConfigError, Principal, Role
from api.context import ApiContext

__all__ = ["ApiContext", "AuthConfig", "AuthConfigError", "Principal", "Role", "create_app"]
