"""A thin, typed asyncio client for the etcd v3 API (``client``), the values and errors it
deals in (``types``), and leases kept alive in the background (``lease``)."""

from controlplane.etcd.client import EtcdClient
from controlplane.etcd.lease import LeaseKeeper
from controlplane.etcd.types import (
    CompactedError,
    ConflictError,
    EtcdError,
    EtcdOutcomeUnknown,
    EtcdStatus,
    EtcdUnavailable,
    EventType,
    KeyValue,
    LeaseNotFoundError,
    WatchBatch,
    WatchEvent,
    prefix_range_end,
)

__all__ = [
    "CompactedError",
    "ConflictError",
    "EtcdClient",
    "EtcdError",
    "EtcdOutcomeUnknown",
    "EtcdStatus",
    "EtcdUnavailable",
    "EventType",
    "KeyValue",
    "LeaseKeeper",
    "LeaseNotFoundError",
    "WatchBatch",
    "WatchEvent",
    "prefix_range_end",
]
