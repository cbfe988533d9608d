"""The envelope every object shares (``apiVersion``, ``kind``, ``metadata``, ``spec``), the
four kinds, and the names a kind goes by (REST paths, etcd keys, CLI aliases)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from policies.models.budget import BudgetSpec
from policies.models.fields import Model, Name
from policies.models.fleet import FleetSpec
from policies.models.policy import RoutingPolicySpec
from policies.models.pool import PoolSpec
from policies.models.rollout import RolloutSpec


class Metadata(Model):
    """Object identity."""

    name: Name = Field(description="Object name, unique per kind.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels.")


class _Object(Model):
    api_version: Literal["kvpilot.io/v1"] = Field(
        "kvpilot.io/v1", description="Always kvpilot.io/v1."
    )
    metadata: Metadata


class Pool(_Object):
    """Replicas serving one model, or an external provider."""

    kind: Literal["Pool"] = "Pool"
    spec: PoolSpec


class RoutingPolicy(_Object):
    """Routes from a listener to pools."""

    kind: Literal["RoutingPolicy"] = "RoutingPolicy"
    spec: RoutingPolicySpec


class Fleet(_Object):
    """Per-fleet listener settings."""

    kind: Literal["Fleet"] = "Fleet"
    spec: FleetSpec = Field(default_factory=FleetSpec)


class Rollout(_Object):
    """A progressive weight change with automatic analysis and rollback."""

    kind: Literal["Rollout"] = "Rollout"
    spec: RolloutSpec


class Budget(_Object):
    """How much one tenant may spend per calendar window."""

    kind: Literal["Budget"] = "Budget"
    spec: BudgetSpec


PolicyObject = Pool | RoutingPolicy | Fleet | Rollout | Budget
KINDS: dict[str, type[PolicyObject]] = {
    "Pool": Pool,
    "RoutingPolicy": RoutingPolicy,
    "Fleet": Fleet,
    "Rollout": Rollout,
    "Budget": Budget,
}

KIND_PATHS: dict[str, str] = {
    "Pool": "pools",
    "RoutingPolicy": "routingpolicies",
    "Fleet": "fleets",
    "Rollout": "rollouts",
    "Budget": "budgets",
}
"""Each kind's plural: its REST path segment (``/v1/pools``) and its etcd key segment."""

PATH_KINDS: dict[str, str] = {path: kind for kind, path in KIND_PATHS.items()}
"""The inverse of ``KIND_PATHS``: a plural (``pools``) -> its kind (``Pool``)."""

_KIND_ALIASES = {
    **{kind.lower(): kind for kind in KIND_PATHS},
    **PATH_KINDS,
    "policy": "RoutingPolicy",
    "policies": "RoutingPolicy",
    "rp": "RoutingPolicy",
}


def kind_named(text: str) -> str | None:
    """The kind a user means: ``Pool``, ``pool`` or ``pools`` -> ``Pool``; also ``rp`` and
    ``policy`` for RoutingPolicy. None when `text` names no kind."""
    return text if text in KIND_PATHS else _KIND_ALIASES.get(text.lower())
