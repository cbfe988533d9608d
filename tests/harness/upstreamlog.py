"""Entries of Envoy's router upstream log, as the arrivals book reads them (``xdsserver.arrivals``).

One builder for the pure tests of spill and overflow: an attempt's start or end, its cluster,
host, attempt number, start time and, for an end, the times to its first and last byte.
"""

from __future__ import annotations

from envoy.data.accesslog.v3 import accesslog_pb2

START = accesslog_pb2.AccessLogType.UpstreamPoolReady
END = accesslog_pb2.AccessLogType.UpstreamEnd


def upstream_entry(
    kind: accesslog_pb2.AccessLogType.ValueType,
    *,
    cluster: str = "chat/chat/local",
    address: str = "10.0.1.1",
    port: int = 8000,
    attempt: int = 1,
    start_us: int | None = None,
    first: float | None = None,
    last: float | None = None,
    status: int = 200,
) -> accesslog_pb2.HTTPAccessLogEntry:
    """One upstream log entry. `start_us` is the request's start time in microseconds (the
    book matches an end to its start by it and the attempt); `first` and `last` are seconds
    from the start to the first and last byte the upstream sent."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.access_log_type = kind
    common.upstream_cluster = cluster
    common.upstream_request_attempt_count = attempt
    if start_us is not None:
        common.start_time.FromMicroseconds(start_us)
    common.upstream_remote_address.socket_address.address = address
    common.upstream_remote_address.socket_address.port_value = port
    if first is not None:
        common.time_to_first_upstream_rx_byte.FromNanoseconds(int(first * 1e9))
    if last is not None:
        common.time_to_last_upstream_rx_byte.FromNanoseconds(int(last * 1e9))
    entry.response.response_code.value = status
    return entry
