"""A thin, typed asyncio client for the etcd v3 API (``client``), the values and errors it
deals in (``types``), leases kept alive in the background (``lease``), and how it proves who
it is to etcd (``security``)."""

from controlplane.etcd.client import EtcdClient
from controlplane.etcd.lease import LeaseKeeper
from controlplane.etcd.security import EtcdSecurity
from controlplane.etcd.types import (
    CompactedError,
    ConflictError,
    EtcdAccessDenied,
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
    "EtcdAccessDenied",
    "EtcdClient",
    "EtcdError",
    "EtcdOutcomeUnknown",
    "EtcdSecurity",
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
