"""The tokens every test uses: one admin token and one read token, for the in-process API and
for `kvpilot serve` processes alike, and the headers that carry them."""

from __future__ import annotations

from api.auth import AuthConfig

ADMIN_TOKEN = "admin-token-0123456789abcdef"
READ_TOKEN = "read-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
"""Request headers of an admin."""
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
"""Request headers of a reader."""
TOKEN_ENV = {"KVPILOT_ADMIN_TOKEN": ADMIN_TOKEN, "KVPILOT_READ_TOKEN": READ_TOKEN}
"""The environment that gives a `kvpilot serve` process both tokens."""


def auth_config() -> AuthConfig:
    """An admin token and a read token, as the in-process API takes them."""
    return AuthConfig([("ops", "admin", ADMIN_TOKEN), ("viewer", "read", READ_TOKEN)])
