"""A short history of each endpoint's telemetry, for the console's sparklines.

etcd holds only the latest telemetry record per endpoint; the reconciler sees every record as
it arrives, so it keeps the last few here. Memory is bounded: ``size`` samples per endpoint,
and an endpoint's history goes when its record does.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from signals.telemetry import TelemetryRecord

HISTORY_FIELDS = ("waiting", "running", "kv_cache", "pending_tokens")
"""The signals kept per sample, after its time ``at``."""


class TelemetryHistory:
    """Pool -> endpoint id -> the last ``size`` telemetry samples, oldest first."""

    def __init__(self, size: int = 60) -> None:
        self.size = size
        self._samples: dict[tuple[str, str], deque[tuple[float | None, ...]]] = {}

    def add(self, pool: str, endpoint_id: str, record: TelemetryRecord) -> None:
        """Append a record's signals; a record already seen (same scrape time) is skipped."""
        samples = self._samples.get((pool, endpoint_id))
        if samples is None:
            samples = self._samples[(pool, endpoint_id)] = deque(maxlen=self.size)
        if samples and samples[-1][0] == record.at:
            return
        samples.append((record.at, *(getattr(record, name) for name in HISTORY_FIELDS)))

    def forget(self, pool: str, endpoint_id: str) -> None:
        self._samples.pop((pool, endpoint_id), None)

    def samples(self, pool: str, endpoint_id: str) -> dict[str, Any]:
        """Column-wise, as the console draws them: ``{"at": [...], "waiting": [...], ...}``."""
        rows = self._samples.get((pool, endpoint_id), ())
        columns: dict[str, Any] = {"at": [row[0] for row in rows]}
        for index, name in enumerate(HISTORY_FIELDS, start=1):
            columns[name] = [row[index] for row in rows]
        return columns
