"""How ``kvpilot get`` shows each kind of object as a table: one registry, keyed by kind, that
also gives ``get --help`` its list of kinds. A kind added to ``policies.KIND_PATHS`` without
a table here fails the CLI tests, so no kind falls back to another kind's columns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from commands.cli.spend import price_text
from policies import KIND_PATHS, PolicyError, Pool, parse_object

ENDPOINTS_VIEW = ("endpoints", "endpoint", "ep")
"""The ``get`` kind words of the endpoints view (live weights and health), not an object."""


@dataclass(frozen=True, slots=True)
class KindTable:
    """The columns that tell objects of one kind apart at a glance."""

    header: tuple[str, ...]
    row: Callable[[dict[str, Any]], list[str]]
    """One object (as the REST API returns it) -> its cells, in header order."""


def join(values: Any, limit: int = 3) -> str:
    """Up to `limit` values joined by commas, then how many more; "-" for none."""
    items = [str(v) for v in values or []]
    shown = ",".join(items[:limit])
    return (shown + f",+{len(items) - limit}" if len(items) > limit else shown) or "-"


def _pool(item: dict[str, Any]) -> list[str]:
    spec = item.get("spec", {})
    try:
        obj = parse_object(item)
        external = "yes" if isinstance(obj, Pool) and obj.spec.external else "no"
    except PolicyError:
        external = "?"
    return [
        item["metadata"]["name"],
        join(spec.get("models")),
        str(len(spec.get("endpoints", []))),
        str(spec.get("protocol", "-")),
        external,
        price_text(spec.get("price")),
    ]


def _policy(item: dict[str, Any]) -> list[str]:
    spec = item.get("spec", {})
    listener = spec.get("listener", {})
    return [
        item["metadata"]["name"],
        f"{listener.get('address', '')}:{listener.get('port', '')}",
        join(spec.get("fleets")),
        join([route.get("name") for route in spec.get("routes", [])]),
    ]


def _fleet(item: dict[str, Any]) -> list[str]:
    spec = item.get("spec", {})
    return [
        item["metadata"]["name"],
        str(spec.get("maxRequestBodyBytes", "-")),
        str(spec.get("secretsDir", "-")),
        str(spec.get("accessLog", "-")).lower(),
    ]


def _step(step: dict[str, Any]) -> str:
    """A step as its canary weight (``10%``) or its explicit split (``a=90/b=10``)."""
    if step.get("weight") is not None:
        return f"{step['weight']}%"
    weights = step.get("weights") or {}
    return "/".join(f"{pool}={weight}" for pool, weight in weights.items()) or "?"


def _rollout(item: dict[str, Any]) -> list[str]:
    spec = item.get("spec", {})
    target = spec.get("target", {})
    where = f"{target.get('policy', '?')}/{target.get('route', '?')}"
    if target.get("tier"):
        where += f" tier {target['tier']}"
    return [
        item["metadata"]["name"],
        where,
        str(spec.get("stable") or "-"),
        str(spec.get("canary") or "-"),
        join([_step(step) for step in spec.get("steps", [])], limit=5),
        join(spec.get("fleets")),
        str(spec.get("onFailure", "rollback")),
    ]


def _budget(item: dict[str, Any]) -> list[str]:
    spec = item.get("spec", {})
    limit = (
        f"{spec['tokens']} tokens"
        if spec.get("tokens") is not None
        else f"{spec.get('amount')} {spec.get('currency', '')}"
    )
    scope = ",".join(f"{field}={spec[field]}" for field in ("class", "model") if spec.get(field))
    action = spec.get("action", "reject")
    if action == "divert":
        action += f" to {spec.get('divertTo')}"
    return [
        item["metadata"]["name"],
        str(spec.get("tenant", "")),
        limit,
        f"{spec.get('window', '')} (UTC)",
        scope or "all",
        action,
    ]


TABLES: dict[str, KindTable] = {
    "Pool": KindTable(("NAME", "MODELS", "ENDPOINTS", "PROTOCOL", "EXTERNAL", "PRICE"), _pool),
    "RoutingPolicy": KindTable(("NAME", "LISTENER", "FLEETS", "ROUTES"), _policy),
    "Fleet": KindTable(("NAME", "MAX BODY", "SECRETS DIR", "ACCESS LOG"), _fleet),
    "Rollout": KindTable(
        ("NAME", "TARGET", "STABLE", "CANARY", "STEPS", "CANARY FLEETS", "ON FAILURE"), _rollout
    ),
    "Budget": KindTable(("NAME", "TENANT", "LIMIT", "WINDOW", "SCOPE", "ACTION"), _budget),
}
"""Kind -> its table; every kind of ``policies.KIND_PATHS`` has one."""


def object_rows(kind: str, items: list[dict[str, Any]]) -> list[list[str]]:
    """The header and one row per object of `kind`."""
    view = TABLES[kind]
    return [list(view.header), *(view.row(item) for item in items)]


def kinds_help() -> str:
    """The kinds ``get`` takes, from the kind registry: each kind's name and plural."""
    kinds = ", ".join(f"{kind.lower()} ({plural})" for kind, plural in KIND_PATHS.items())
    return f"{kinds}, {ENDPOINTS_VIEW[0]} (live weights and health), or spend"
