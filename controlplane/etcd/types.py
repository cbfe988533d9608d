"""What the etcd client returns and raises: keys with their revisions, watch events, member
status, and the typed errors of its failure model (see ``controlplane.etcd.client``)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CompactedError",
    "ConflictError",
    "EtcdAccessDenied",
    "EtcdClosed",
    "EtcdError",
    "EtcdOutcomeUnknown",
    "EtcdStatus",
    "EtcdUnavailable",
    "EventType",
    "KeyValue",
    "LeaseNotFoundError",
    "WatchBatch",
    "WatchEvent",
    "prefix_range_end",
]


class EtcdError(Exception):
    """Base class for etcd failures; the message says what to do about it."""


class EtcdClosed(EtcdError):
    """The client was closed: nothing will succeed on it again, so a loop stops instead of
    retrying. A call under way when the client closes raises it too, not the CancelledError
    that gRPC raises in a task nobody cancelled."""


class EtcdUnavailable(EtcdError):
    """No etcd endpoint could be reached within the call's timeout."""


class EtcdOutcomeUnknown(EtcdUnavailable):
    """A write was sent and not confirmed: it may or may not have been applied."""


class ConflictError(EtcdError):
    """A conditional write failed because the key's ``mod_revision`` was not the expected one."""

    def __init__(
        self, key: bytes, actual_mod_revision: int, expected_mod_revision: int | None = None
    ) -> None:
        self.key = key
        self.actual_mod_revision = actual_mod_revision
        self.expected_mod_revision = expected_mod_revision
        super().__init__(self._sentence())

    def _sentence(self) -> str:
        name = self.key.decode(errors="backslashreplace")
        if self.expected_mod_revision == 0:
            return (
                f"{name} already exists (mod_revision {self.actual_mod_revision}); "
                "read it and update it instead of creating it"
            )
        if self.actual_mod_revision == 0:
            return (
                f"{name} does not exist (expected mod_revision {self.expected_mod_revision}); "
                "it was deleted, create it again if you still want it"
            )
        return (
            f"{name} changed: expected mod_revision {self.expected_mod_revision}, "
            f"it is now {self.actual_mod_revision}; re-read it and retry"
        )


class CompactedError(EtcdError):
    """The requested revision has been compacted; the caller must re-list and watch anew."""

    def __init__(self, compact_revision: int, requested_revision: int | None = None) -> None:
        self.compact_revision = compact_revision
        self.requested_revision = requested_revision
        wanted = f" revision {requested_revision}" if requested_revision is not None else ""
        super().__init__(
            f"etcd history{wanted} was compacted (compact revision {compact_revision}); "
            "re-list the keys and watch from the list's revision"
        )


class LeaseNotFoundError(EtcdError):
    """A write referred to a lease that has expired or was revoked."""


class EtcdAccessDenied(EtcdError):
    """etcd refused our identity or our permission; the message names what to check."""


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_pb(cls, kv: Any) -> KeyValue:
        return cls(
            key=kv.key,
            value=kv.value,
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change. For ``DELETE``, ``kv.value == b""`` and ``kv.mod_revision`` is the delete's."""

    type: EventType
    kv: KeyValue


class WatchBatch(list[WatchEvent]):
    """The events of one etcd ``WatchResponse``; a list, plus where the watch stands.

    ``revision``: every change up to and including this revision has been delivered, so a
    watch resumed after a disconnect starts at ``revision + 1``. ``header_revision``: etcd's
    current revision when it sent the response. A batch may be empty: the first batch of
    every watch (the watch is established) and etcd's progress notifications.
    """

    __slots__ = ("header_revision", "revision")

    def __init__(self, events: Sequence[WatchEvent], revision: int, header_revision: int) -> None:
        super().__init__(events)
        self.revision = revision
        self.header_revision = header_revision

    def __repr__(self) -> str:
        return f"WatchBatch({list.__repr__(self)}, revision={self.revision})"


@dataclass(frozen=True, slots=True)
class EtcdStatus:
    """What readiness checks need from the member the client talks to."""

    endpoint: str
    version: str
    revision: int
    member_id: int
    leader: int
    raft_term: int
    db_size: int

    @property
    def has_leader(self) -> bool:
        return self.leader != 0


def prefix_range_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # empty prefix, or all 0xff: every key
