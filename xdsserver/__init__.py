"""Routing plan -> Envoy resources -> per-fleet snapshots -> ADS (SotW and Delta) to Envoys.

- ``translate``: plan to CDS/EDS/LDS/RDS protos (pure);
- ``snapshot``: immutable, content-versioned snapshots, serialized once, cached per fleet;
- ``incremental``: a fleet's next snapshot from the one served now, with only what changed;
- ``server``: the ADS gRPC server; ``sotw`` and ``delta``: its two protocol variants over
  ``stream``, what they share;
- ``status``: what every connected Envoy has, and why it rejected something;
- ``static``: a fleet's resources as a static bootstrap, for ``envoy --mode validate``.
"""

from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, PUSH_ORDER, ROUTE, Resource
from xdsserver.server import AdsServer
from xdsserver.snapshot import Snapshot, SnapshotCache
from xdsserver.status import ConnectionRegistry, ConnectionStatus

__all__ = [
    "CLUSTER",
    "ENDPOINT",
    "LISTENER",
    "PUSH_ORDER",
    "ROUTE",
    "AdsServer",
    "ConnectionRegistry",
    "ConnectionStatus",
    "Resource",
    "Snapshot",
    "SnapshotCache",
]
