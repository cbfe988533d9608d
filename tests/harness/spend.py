"""What the spend and budget end-to-end tests share: a policy with a paid pool (priced per
token) and an owned pool (priced per replica-hour) behind one Envoy, the spend view read
through the REST API, and Budget objects."""

from __future__ import annotations

from collections import Counter
from typing import Any

from harness.builders import FAST_HEALTH_CHECK, policy, pool, route
from harness.rig import BackendFactory, Rig, ports_of
from harness.wait import wait_until
from replicasim.simulator import SimConfig

PRICE = {"currency": "USD", "input": "2.50", "cachedInput": "1.25", "output": "10"}
"""The paid pool's price per million tokens."""
FAST_SIM = SimConfig(stream_interval=0.01)


def spend_policy(port: int) -> dict[str, Any]:
    return policy(
        "web",
        port,
        [
            route("paid", name="paid", match={"models": ["m-paid"]}),
            route("owned", name="owned", match={"models": ["m-owned"]}),
        ],
    )


def start(rig: Rig, backends: BackendFactory) -> tuple[Any, Any]:
    paid = backends(2, id_prefix="paid", model="m-paid", simulator=FAST_SIM)
    owned = backends(1, id_prefix="owned", model="m-owned", simulator=FAST_SIM)
    rig.apply(
        pool(
            "paid",
            ports_of(paid),
            models=["m-paid"],
            health_check=FAST_HEALTH_CHECK,
            price=PRICE,
        ),
        pool(
            "owned",
            ports_of(owned),
            models=["m-owned"],
            health_check=FAST_HEALTH_CHECK,
            price={"replicaHour": "4.20"},
        ),
        spend_policy(rig.listener_port),
    )
    rig.wait_ready("web/paid", ports_of(paid))
    rig.wait_ready("web/owned", ports_of(owned))
    return paid, owned


def spend(rig: Rig, **params: str) -> dict[str, Any]:
    response = rig.api.get("/v1/spend", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def by(rig: Rig, field: str, **params: str) -> dict[str, Counter[str]]:
    """Counters summed by one field (rows are also split by currency)."""
    out: dict[str, Counter[str]] = {}
    for row in spend(rig, by=field, **params)["rows"]:
        counts = out.setdefault(row[field], Counter())
        for name, value in row.items():
            if isinstance(value, int) and name != field:
                counts[name] += value
    return out


def pool_rows(rig: Rig) -> dict[str, Counter[str]]:
    return by(rig, "pool")


def wait_counted(rig: Rig, requests: int) -> None:
    wait_until(
        lambda: sum(row["requests"] for row in pool_rows(rig).values()) >= requests,
        30,
        message=f"kvpilot to count {requests} responses",
    )


def budget(name: str, tenant: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.io/v1",
        "kind": "Budget",
        "metadata": {"name": name},
        "spec": {"tenant": tenant, **spec},
    }
