"""The Envoys connected per fleet, as the reconciler keeps them from the mirror's changes of
the status records every kvpilot replica publishes (``overflow.maxInFlight: auto`` splits
the batch slots over them): pure, no etcd."""

from __future__ import annotations

import json

from controlplane.envoystatus import ENVOYS_PREFIX, EnvoyCounts
from controlplane.etcd import KeyValue


def _record(fleet: str, version: str = "v1") -> KeyValue:
    body = json.dumps({"fleet": fleet, "types": {"cds": version}}).encode()
    return KeyValue(key=b"", value=body, create_revision=1, mod_revision=1, version=1, lease=0)


def test_envoys_are_counted_per_fleet_as_they_come_and_go() -> None:
    counts = EnvoyCounts()
    a, b, c = (
        f"{ENVOYS_PREFIX}{replica}/{node}"
        for replica, node in (("r1", "e1"), ("r1", "e2"), ("r2", "e3"))
    )
    items = {a: _record("default"), b: _record("default"), c: _record("edge")}
    assert counts.update(items, items) and counts.counts() == {"default": 2, "edge": 1}
    # A push rewrites the records (new versions): nothing moves.
    items = {**items, a: _record("default", "v2")}
    assert not counts.update({a}, items)
    # An Envoy goes; other keys are not Envoys.
    del items[b]
    assert counts.update({b, "objects/pools/chat"}, items)
    assert counts.counts() == {"default": 1, "edge": 1}
    # A re-list replaces everything: a record gone while the watch was down is forgotten.
    assert counts.update(set(), {c: items[c]}, full=True)
    assert counts.counts() == {"edge": 1}
    # A record that is not kvpilot's JSON is not an Envoy.
    junk = KeyValue(key=b"", value=b"{", create_revision=1, mod_revision=1, version=1, lease=0)
    assert not counts.update({a}, {c: items[c], a: junk})
