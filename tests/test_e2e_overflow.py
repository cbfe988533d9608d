"""Cost-aware overflow through a real Envoy: requests go to a paid pool only while the owned
replicas are saturated, conversations stay on the owned replicas while they can take them,
traffic returns without flapping, and a paid pool that answers 429 rests for its
Retry-After, for the Envoys of every kvpilot replica.

The owned replicas' telemetry is written straight into etcd, as an agent writes it, so the
test decides when they are saturated; everything after etcd is the real path (kvpilot
compiles the overflow share, pushes RDS, Envoy draws per request). The paid pools are
stand-ins on ``localhost`` (a DNS name, so each is an external provider with a cluster of its
own) that answer 200, or 429 with a Retry-After, as the test says.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool
from harness.paid import overflow_entries, paid_pool, paid_stand_in, put_fill
from harness.rig import KvpilotFactory, Rig, api_client
from harness.wait import wait_until

from controlplane.local import EmbeddedEtcd, free_port

pytestmark = pytest.mark.e2e

CLUSTER = "paid/chat"
SESSION = {"x-session-id": "conversation-1"}


def answered_by(client: httpx.Client, rig: Rig, n: int, headers: dict[str, str]) -> list[str]:
    out = []
    for _ in range(n):
        answer = client.post(rig.url(), json=chat(), headers=headers)
        assert answer.status_code == 200, answer.text
        out.append(answer.headers.get("x-backend-id", ""))
    return out


def test_overflow_to_a_paid_pool_when_the_owned_pool_saturates_and_back(
    rig: Rig, backends: Any, etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    replicas = backends(2, id_prefix="owned")
    ports = [r.port for r in replicas.replicas]
    with paid_stand_in("paid") as paid:
        route = {
            "name": "chat",
            "tiers": [["owned"]],
            "sessionAffinity": {"header": "x-session-id"},
            "overflow": {
                "pools": ["paid"],
                "signal": "fill",
                # One step moves all requests of a kind. The next rise (conversations) may
                # not come before the test has put the fill inside the band.
                "step": 100,
                "raiseInterval": "10s",
                "recoverInterval": "2s",
            },
        }
        rig.apply(
            pool("owned", ports, telemetry={"maxAge": "60s"}, health_check=FAST_HEALTH_CHECK),
            paid_pool("paid", paid.port),
            policy("paid", rig.listener_port, [route]),
        )
        rig.wait_ready(CLUSTER, ports)
        client = httpx.Client(timeout=10)
        owned = {r.id for r in replicas.replicas}

        # Room on the owned replicas (fill 0.3): nothing goes to the paid pool.
        put_fill(etcd, etcd_prefix, ports, 0.3)
        assert set(answered_by(client, rig, 10, {})) <= owned
        assert set(answered_by(client, rig, 5, SESSION)) <= owned
        assert paid.hits == 0 and overflow_entries(rig) == {}

        # Saturated (fill 1.2 against a bound of 0.9): requests without a session go paid.
        saturated_at = time.monotonic()
        put_fill(etcd, etcd_prefix, ports, 1.2)
        wait_until(
            lambda: answered_by(client, rig, 1, {}) == ["paid"], 30, message="overflow to paid"
        )
        took = time.monotonic() - saturated_at
        assert answered_by(client, rig, 10, {}) == ["paid"] * 10
        # The owned replicas have room at the bound again (fill 0.85, pressure 0.94, inside
        # the band): the overflow holds and conversations stay on the owned replicas.
        put_fill(etcd, etcd_prefix, ports, 0.85)
        entries = wait_until(lambda: overflow_entries(rig), 10, message="the overflow entry")
        assert list(entries) == ["paid/chat#0/overflow"], entries  # none for conversations
        assert set(answered_by(client, rig, 10, SESSION)) <= owned
        held_until = time.monotonic() + 3  # longer than the recover interval
        while time.monotonic() < held_until:
            assert overflow_entries(rig) == entries, "the share moved inside the band"
            time.sleep(0.2)
        assert answered_by(client, rig, 5, {}) == ["paid"] * 5

        # Room again (fill 0.3): the share comes back and traffic returns to the owned pool.
        calm_at = time.monotonic()
        put_fill(etcd, etcd_prefix, ports, 0.3)
        wait_until(lambda: overflow_entries(rig) == {}, 30, message="the overflow to end")
        returned = time.monotonic() - calm_at
        before = paid.hits
        assert set(answered_by(client, rig, 10, {})) <= owned
        assert paid.hits == before
        print(f"overflow began {took:.2f} s after saturation, ended {returned:.2f} s after calm")


def test_a_paid_pool_that_answers_429_rests_for_its_retry_after(rig: Rig, backends: Any) -> None:
    replicas = backends(1, id_prefix="owned")
    ports = [r.port for r in replicas.replicas]
    with paid_stand_in("cheap") as cheap, paid_stand_in("dear") as dear:
        route = {
            "name": "chat",
            "tiers": [["owned"]],
            # A static split of everything to the paid pools: no telemetry needed.
            "overflow": {
                "pools": ["cheap", "dear"],
                "minShare": 100,
                "conversations": "with",
            },
        }
        rig.apply(
            pool("owned", ports, health_check=FAST_HEALTH_CHECK),
            paid_pool("cheap", cheap.port),
            paid_pool("dear", dear.port),
            policy("paid", rig.listener_port, [route]),
        )
        rig.wait_ready(CLUSTER, ports)
        client = httpx.Client(timeout=10)
        wait_until(
            lambda: answered_by(client, rig, 1, {}) == ["cheap"], 30, message="the cheapest pool"
        )
        assert overflow_entries(rig)["paid/chat#0/overflow"][0] == "paid/chat/overflow/cheap"

        # The cheap pool answers 429 with Retry-After 4: the request that met it is retried on
        # the next pool at once, and kvpilot moves the overflow there for 4 s.
        cheap.retry_after = "4"
        first = client.post(rig.url(), json=chat())
        assert first.status_code == 200 and first.headers["x-backend-id"] == "dear"
        assert cheap.first_429 is not None
        wait_until(
            lambda: overflow_entries(rig)["paid/chat#0/overflow"][0] == "paid/chat/overflow/dear",
            10,
            message="the overflow to move to the next pool",
        )
        moved = time.monotonic() - cheap.first_429
        cheap.retry_after = None
        refused = cheap.refused
        hits = cheap.hits
        assert set(answered_by(client, rig, 5, {})) == {"dear"}
        assert cheap.hits == hits  # resting: not even tried

        # Back once the rest is over, and not before.
        wait_until(
            lambda: overflow_entries(rig)["paid/chat#0/overflow"][0] == "paid/chat/overflow/cheap",
            30,
            message="the cheap pool back after its Retry-After",
        )
        rested = time.monotonic() - cheap.first_429
        assert rested >= 4.0
        assert answered_by(client, rig, 3, {}) == ["cheap"] * 3
        assert cheap.refused == refused
        print(f"a 429 moved the overflow in {moved:.2f} s; the pool rested {rested:.2f} s")


def test_a_429_seen_by_one_replica_rests_the_pool_for_every_replicas_envoys(
    etcd_prefix: str, kvpilot_factory: KvpilotFactory, envoy_factory: Any, backends: Any
) -> None:
    """Envoys of fleet `a` talk to one kvpilot, those of fleet `b` to another. Only fleet
    `a`'s Envoy meets the 429; fleet `b`'s stops sending to the pool all the same, through
    the rest replica `a` writes to etcd, and both come back when the rest is over."""
    kvpilots = {
        name: kvpilot_factory(etcd_prefix, extra_args=["--replica-id", name]) for name in "ab"
    }
    rigs = {
        name: Rig(
            kvpilot,
            envoy_factory(xds_port=kvpilot.xds_port, fleet=name),
            api_client(kvpilot),
            free_port(),
        )
        for name, kvpilot in kvpilots.items()
    }
    replicas = backends(1, id_prefix="owned")
    ports = [r.port for r in replicas.replicas]
    retry_after = 6.0
    with (
        rigs["a"].api,
        rigs["b"].api,
        paid_stand_in("cheap") as cheap,
        paid_stand_in("dear") as dear,
    ):
        route = {
            "name": "chat",
            "tiers": [["owned"]],
            "overflow": {"pools": ["cheap", "dear"], "minShare": 100, "conversations": "with"},
        }
        rigs["a"].apply(
            pool("owned", ports, health_check=FAST_HEALTH_CHECK),
            paid_pool("cheap", cheap.port),
            paid_pool("dear", dear.port),
            *(
                policy(f"paid-{name}", rig.listener_port, [route], fleets=[name])
                for name, rig in rigs.items()
            ),
        )
        client = httpx.Client(timeout=10)

        def overflow_pool(name: str) -> str:
            entry = overflow_entries(rigs[name]).get(f"paid-{name}/chat#0/overflow")
            return entry[0].rsplit("/", 1)[-1] if entry is not None else ""

        for name, rig in rigs.items():
            rig.wait_ready(f"paid-{name}/chat", ports)
            wait_until(
                lambda rig=rig: answered_by(client, rig, 1, {}) == ["cheap"],
                30,
                message=f"fleet {name}'s Envoy to send to the cheapest pool",
            )

        # Only fleet a's Envoy meets the 429 (its request is retried on the next pool).
        cheap.retry_after = f"{retry_after:.0f}"
        first = client.post(rigs["a"].url(), json=chat())
        assert first.status_code == 200 and first.headers["x-backend-id"] == "dear"
        assert cheap.first_429 is not None and cheap.refused == 1
        for name in "ab":
            wait_until(
                lambda name=name: overflow_pool(name) == "dear",
                10,
                message=f"fleet {name}'s overflow to move to the next pool",
            )
        moved = time.monotonic() - cheap.first_429
        cheap.retry_after = None
        hits = cheap.hits
        for rig in rigs.values():
            assert set(answered_by(client, rig, 5, {})) == {"dear"}
        assert cheap.hits == hits  # resting for both fleets: not even tried
        assert cheap.refused == 1  # fleet b's Envoy never met the 429 itself

        # Both back once the rest is over, and not before.
        back: dict[str, float] = {}
        for name in "ab":
            wait_until(
                lambda name=name: overflow_pool(name) == "cheap",
                30,
                message=f"fleet {name}'s overflow back on the cheap pool after its Retry-After",
            )
            back[name] = time.monotonic() - cheap.first_429
        assert min(back.values()) >= retry_after
        for rig in rigs.values():
            assert answered_by(client, rig, 3, {}) == ["cheap"] * 3
        print(
            f"a 429 through fleet a moved both fleets' overflow in {moved:.2f} s; "
            f"back after {back['a']:.2f} s (a) and {back['b']:.2f} s (b)"
        )
