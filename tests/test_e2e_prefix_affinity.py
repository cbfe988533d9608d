"""Prompt-prefix affinity without session IDs, through a real Envoy.

Envoy's Lua filter hashes the first characters of the prompt into a header and the ring hash
uses it, so requests sharing a long prefix meet the same replica's prefix cache.
"""

from __future__ import annotations

import collections

import httpx
import pytest
from harness.builders import policy, pool, route
from harness.rig import BackendFactory, Rig, ports_of
from harness.wait import wait_until

pytestmark = pytest.mark.e2e

SYSTEM = "You are assistant number {n}. " + "Follow the house style guide carefully. " * 40


def apply_prefix_route(rig: Rig, name: str, ports: list[int], affinity: dict[str, int]) -> None:
    """A pool `name` and a round-robin route to it with `affinity` as its sessionAffinity."""
    rig.apply(
        pool(name, ports),
        policy(
            name,
            rig.listener_port,
            [route(name, name="chat", balancing="round_robin", sessionAffinity=affinity)],
        ),
    )


def ask(client: httpx.Client, url: str, prompt: int, question: str) -> str:
    """Send a chat turn whose system prompt is prompt number `prompt`; the replica that
    answered."""
    body = {
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": SYSTEM.format(n=prompt)},
            {"role": "user", "content": question},
        ],
    }
    reply = client.post(url, json=body)
    assert reply.status_code == 200, reply.text
    return reply.headers["x-backend-id"]


def test_requests_sharing_a_long_prompt_prefix_land_on_one_replica(
    rig: Rig, backends: BackendFactory
) -> None:
    replicas = backends(3, id_prefix="px")
    apply_prefix_route(rig, "px", ports_of(replicas), {"prefixHashChars": 1024})
    url = rig.url()
    client = httpx.Client(timeout=10)
    wait_until(lambda: ask(client, url, 0, "warm-up"), 30, message="the policy to reach Envoy")
    placement: dict[int, collections.Counter[str]] = {}
    for prompt in range(16):
        placement[prompt] = collections.Counter(
            ask(client, url, prompt, f"question {turn} for prompt {prompt}") for turn in range(4)
        )
    # Every prompt stays on one replica although its requests differ after the prefix ...
    assert all(len(counts) == 1 for counts in placement.values()), placement
    # ... and different prompts do not all collapse onto one replica (p < 1e-7 by chance).
    used = {replica for counts in placement.values() for replica in counts}
    assert len(used) >= 2, placement

    # Without prefix hashing the same requests would spread: round robin is the fallback
    # for requests whose body carries no prompt at all.
    spread = collections.Counter(
        client.post(url, json={"model": "sim-model", "input": "x"}).headers["x-backend-id"]
        for _ in range(6)
    )
    assert len(spread) == 3, spread


def test_a_hot_prompt_prefix_spreads_over_replicas_while_a_rare_one_keeps_its_replica(
    rig: Rig, backends: BackendFactory
) -> None:
    replicas = backends(3, id_prefix="hot")
    # Each 10% of the prefix-hashed requests is worth a ring point: a prefix with nine
    # tenths of them gets nine, which fall on one replica of three with p < 1e-4.
    apply_prefix_route(
        rig, "hot", ports_of(replicas), {"prefixHashChars": 1024, "hotPrefixShare": 10}
    )
    url = rig.url()
    # One connection, so one Envoy worker, whose Lua state counts every request.
    client = httpx.Client(timeout=10)
    wait_until(lambda: ask(client, url, 1, "warm-up"), 30, message="the policy to reach Envoy")
    # The first 200 keyed requests only count: until then even the hot prefix keeps one
    # replica, as every prefix did before.
    early: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    late: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for n in range(400):
        prompt = 0 if n % 10 else 1 + (n // 10) % 4  # prompt 0 hot, 1-4 rare
        placement = early if n < 150 else late if n >= 250 else None
        backend = ask(client, url, prompt, f"question {n}")
        if placement is not None:
            placement[prompt][backend] += 1
    assert all(len(counts) == 1 for counts in early.values()), early
    assert len(late[0]) >= 2, late
    # The rare prefixes keep their replica.
    assert all(len(late[prompt]) == 1 for prompt in range(1, 5)), late
