"""A protocol property test for both ADS variants, against a client that NACKs.

For random sequences of good and bad snapshots, a Python client that answers like Envoy
(in order, whole responses, keeping what it had after a NACK) rejects every response holding
a poisoned resource and, at random, some good ones. After each snapshot the stream settles
(the client holds that snapshot's versions, or has rejected them);
then the properties must hold:

- no version the client rejected is sent to it again once the server took in the NACK;
- every NACK is counted (``kvpilot_xds_nacks_total``) and the last one shown in status;
- once a last, good snapshot is set (and the client stops rejecting at random), what the
  client runs is exactly that snapshot.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from harness.wait import poll
from harness.xdsclient import (
    DeltaStream,
    RunningServer,
    SotwStream,
    make_cluster,
    make_endpoints,
    make_listener,
    unpack,
)

from xdsserver import delta as xds_delta
from xdsserver import sotw as xds_sotw
from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, Resource, short_name
from xdsserver.snapshot import Snapshot
from xdsserver.stream import Push, Stream

CLUSTERS = ("a", "b", "c", "d")
LISTENERS = ("l1", "l2", "l3")
POISON = "bad"
"""A cluster or listener of this name is rejected by the client, as Envoy rejects a listener
whose port is taken."""
EDS_NAMES = (*CLUSTERS, POISON, "final")
SETTLE_DEADLINE = 30.0
"""Seconds a stream may take to settle (generous: the server answers within milliseconds)."""


def random_snapshot(rng: random.Random, *, poison: bool, final: bool = False) -> Snapshot:
    clusters = [c for c in CLUSTERS if rng.random() < 0.6] + (["final"] if final else [])
    # The final snapshot's versions are new: one rejected at random earlier is, rightly,
    # never sent again.
    listeners = [name for name in LISTENERS if rng.random() < 0.6] + (["final"] if final else [])
    if poison:
        if rng.random() < 0.5:
            clusters.append(POISON)
        else:
            listeners.append(POISON)
    return Snapshot.from_messages(
        {
            CLUSTER: [make_cluster(c, timeout_ms=rng.choice((250, 500))) for c in clusters],
            ENDPOINT: [make_endpoints(c, [rng.choice((1, 2, 3))]) for c in clusters],
            LISTENER: [
                make_listener(name, "routes", port=rng.choice((10_000, 10_001)))
                for name in listeners
            ],
        }
    )


def resource_versions(response: Any, type_url: str) -> dict[str, str]:
    """Name → version of what a response carries (Delta names them; SotW is unpacked)."""
    if hasattr(response, "system_version_info"):
        return {r.name: r.version for r in response.resources}
    out = {}
    for any_msg in response.resources:
        resource = Resource.from_message(unpack(any_msg))
        out[resource.name] = resource.version
    return out


@dataclass
class Client:
    """Envoy's side of one stream, answering every response as it arrives."""

    stream: SotwStream | DeltaStream
    rng: random.Random
    delta: bool
    nack_rate: float = 0.25
    running: dict[str, dict[str, str]] = field(default_factory=dict)
    rejected: dict[str, set[str]] = field(default_factory=dict)
    nacks: Counter[str] = field(default_factory=Counter)
    last_nacked: dict[str, str] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)
    """Every response and its answer, for the failure message."""
    acked: dict[str, str] = field(default_factory=dict)
    """Type URL -> the version of the last response the client ACKed."""

    def version_of(self, response: Any) -> str:
        return str(response.system_version_info if self.delta else response.version_info)

    async def run(self) -> None:
        while True:
            response = await self.stream.recv(within=3600)
            type_url, version = response.type_url, self.version_of(response)
            carried = resource_versions(response, type_url)
            removed = list(getattr(response, "removed_resources", []))
            self.history.append(f"{short_name(type_url)} {version} {sorted(carried)} -{removed}")
            self.rejected.setdefault(type_url, set())
            if POISON in carried or self.rng.random() < self.nack_rate:
                self.history.append("  NACK")
                self.rejected[type_url].add(version)
                self.nacks[type_url] += 1
                self.last_nacked[type_url] = version
                if self.delta:
                    await self.stream.nack(response, "rejected")  # type: ignore[call-arg]
                else:
                    await self.stream.nack(response, "rejected", names=self.names(type_url))  # type: ignore[call-arg]
                continue
            running = self.running.setdefault(type_url, {})
            self.acked[type_url] = version
            if self.delta:
                running.update(carried)
                for name in response.removed_resources:
                    running.pop(name, None)
                await self.stream.ack(response)
            else:
                if type_url == ENDPOINT:
                    running.update(carried)  # named: what a response leaves out is kept
                else:
                    running.clear()
                    running.update(carried)
                await self.stream.ack(response, self.names(type_url))  # type: ignore[call-arg]

    @staticmethod
    def names(type_url: str) -> list[str]:
        return list(EDS_NAMES) if type_url == ENDPOINT else []

    async def subscribe(self) -> None:
        for type_url in (CLUSTER, ENDPOINT, LISTENER):
            await self.stream.send(type_url, self.names(type_url))

    def holds(self, snapshot: Snapshot) -> bool:
        """Whether the client holds `snapshot`'s version of every type: it ACKed a response
        of that version (Envoy's ``version_text``), or rejected that version (the server then
        keeps it from the client, as it must), or already runs exactly the snapshot's
        resources (nothing needs sending)."""
        for type_url in (CLUSTER, ENDPOINT, LISTENER):
            version = snapshot.version(type_url)
            if self.acked.get(type_url) == version or version in self.rejected.get(type_url, set()):
                continue
            expected = {n: r.version for n, r in snapshot.resources(type_url).items()}
            running = self.running.get(type_url, {})
            if type_url == ENDPOINT:  # named: a name the snapshot dropped may stay behind
                running = {n: v for n, v in running.items() if n in expected}
            if running != expected:
                return False
        return True

    async def settled(self, snapshot: Snapshot) -> None:
        """Wait until the client holds `snapshot`'s versions (or rejected them): settled is
        what the client has, never a quiet time on the stream."""
        try:
            await poll(lambda: self.holds(snapshot), SETTLE_DEADLINE, "the snapshot to be held")
        except AssertionError as error:
            want = {short_name(t): snapshot.version(t) for t in (CLUSTER, ENDPOINT, LISTENER)}
            raise AssertionError(f"{error}: {want}\n" + "\n".join(self.history)) from None


@dataclass
class ServerOrder:
    """Rule 3 in the order the server lived it: no response is planned with a version after
    the server took in the NACK of it. (An Envoy may still see a version it rejects again:
    one the server planned before that NACK arrived, such as a second resend of the same
    content.)"""

    rejected: set[tuple[str, str]] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)

    def watch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        record_nack = Stream.record_nack

        def nacked(stream: Stream, type_url: str, version: str, request: Any) -> None:
            self.rejected.add((type_url, version))
            record_nack(stream, type_url, version, request)

        monkeypatch.setattr(Stream, "record_nack", nacked)
        for kind in (xds_sotw.SotwStream, xds_delta.DeltaStream):
            plan = kind.plan

            def planned(stream: Any, snapshot: Any, plan: Any = plan) -> list[Push]:
                pushes: list[Push] = plan(stream, snapshot)
                for push in pushes:
                    if (push.type_url, push.version) in self.rejected:
                        name = short_name(push.type_url)
                        self.violations.append(f"{name} {push.version} sent again")
                return pushes

            monkeypatch.setattr(kind, "plan", planned)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
async def test_no_rejected_version_comes_back_every_nack_counts_and_the_last_good_wins(
    ads: RunningServer, delta: bool, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    order = ServerOrder()
    order.watch(monkeypatch)
    ads.cache.set_snapshot("default", random_snapshot(rng, poison=False))
    stream = ads.delta("envoy-1") if delta else ads.sotw("envoy-1")
    async with stream:
        client = Client(stream, random.Random(seed + 1000), delta)
        await client.subscribe()
        answering = asyncio.create_task(client.run())
        try:
            first = ads.cache.snapshot_for("default")
            assert first is not None
            await client.settled(first)
            for _ in range(6):
                snapshot = random_snapshot(rng, poison=rng.random() < 0.4)
                ads.cache.set_snapshot("default", snapshot)
                await client.settled(snapshot)
            client.nack_rate = 0.0
            last = random_snapshot(rng, poison=False, final=True)
            ads.cache.set_snapshot("default", last)
            await client.settled(last)
        finally:
            answering.cancel()
        if answering.done() and not answering.cancelled() and answering.exception():
            raise answering.exception()  # type: ignore[misc]
        assert order.violations == [], "\n".join(client.history)
        for type_url in (CLUSTER, ENDPOINT, LISTENER):
            name = short_name(type_url)
            counted = ads.metric("kvpilot_xds_nacks_total", type=name, fleet="default")
            assert counted == client.nacks[type_url], name
            [conn] = ads.status.find("envoy-1")
            nack = conn.types[type_url].last_nack
            if client.nacks[type_url]:
                assert nack is not None and nack.version == client.last_nacked[type_url], name
            expected = {n: r.version for n, r in last.resources(type_url).items()}
            running = client.running.get(type_url, {})
            if type_url == ENDPOINT:
                running = {n: v for n, v in running.items() if n in expected}
            assert running == expected, name
