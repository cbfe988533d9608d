"""Overflow driven by the route's arrival rate (``overflow.signal: arrivals``): the policy,
the route's demand from the arrivals log, and the decision (``signals.overflowff``)."""

from __future__ import annotations

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from pydantic import ValidationError

from policies.models import Overflow
from xdsserver.arrivals import ARRIVAL_WINDOW, ArrivalBook, route_demand

START = accesslog_pb2.AccessLogType.UpstreamPoolReady
END = accesslog_pb2.AccessLogType.UpstreamEnd

# --------------------------------------------------------------------------- the policy


def test_signal_defaults_to_the_fill_loop() -> None:
    assert Overflow.model_validate({"pools": ["paid"]}).signal == "fill"
    assert Overflow.model_validate({"pools": ["paid"], "signal": "arrivals"}).signal == "arrivals"


def test_arrivals_with_feed_forward_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="feedForward"):
        Overflow.model_validate({"pools": ["paid"], "signal": "arrivals", "feedForward": 0.5})
    # feedForward 0 is its default: nothing to refuse.
    Overflow.model_validate({"pools": ["paid"], "signal": "arrivals", "feedForward": 0})


def test_an_unknown_signal_is_refused() -> None:
    with pytest.raises(ValidationError, match="signal"):
        Overflow.model_validate({"pools": ["paid"], "signal": "ttft"})


# --------------------------------------------------------------------------- the demand


def _entry(
    kind: int, cluster: str, *, attempt: int = 1, port: int = 8000
) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.access_log_type = kind
    common.upstream_cluster = cluster
    common.upstream_request_attempt_count = attempt
    common.upstream_remote_address.socket_address.address = "10.0.1.1"
    common.upstream_remote_address.socket_address.port_value = port
    entry.response.response_code.value = 200
    return entry


def test_the_route_demand_counts_every_pool_that_took_its_requests() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    for _ in range(8):  # 2 a second on the owned replicas, half of them conversations
        book.observe(_entry(START, "main/chat"), "edge")
        book.observe(_entry(START, "main/chat/affinity"), "edge")
        book.observe(_entry(START, "main/chat/overflow/paid"), "edge")  # 1 a second paid
        book.observe(_entry(START, "main/chat/overflow/paid", attempt=2), "edge")  # a retry
        book.observe(_entry(START, "main/other"), "edge")  # another route
        clock[0] += 0.5
    book.observe(_entry(START, "main/chat"), "core")  # another fleet's Envoys: counted too
    clock[0] += 0.5
    # Over the 4.5 s since the first start: (16 owned + 8 paid) / 4.5 by edge, and core's 1
    # over the same span (its first start is 0.5 s old: under MIN_SPAN, no rate yet).
    assert book.demand("main/chat") == pytest.approx(24 / 4.5, rel=0.01)
    assert book.demand("main/other") == pytest.approx(8 / 4.5, rel=0.01)
    assert book.demand("main/ch") == 0.0  # a prefix of another route's name is not it
    # The spill's rates are what they were: one key per fleet and route cluster.
    assert set(book.rates()) == {
        "edge/main/chat",
        "edge/main/other",
        "edge/main/chat/overflow/paid",
    }
    assert book.session_rates() == {"edge/main/chat": pytest.approx(8 / 4.5, rel=0.01)}
    clock[0] += ARRIVAL_WINDOW
    assert book.demand("main/chat") == 0.0 and book.session_rates() == {}


def test_route_demand_adds_every_replica_and_fleet() -> None:
    rates = {
        "edge/main/chat": 2.0,
        "core/main/chat": 1.0,
        "edge/main/chat/overflow/paid": 0.5,
        "edge/main/chat/provider/paid": 0.25,
        "edge/main/chatty": 9.0,
    }
    assert route_demand(rates, "main/chat") == 3.75


def test_completions_over_a_shorter_window_see_only_the_last_seconds() -> None:
    clock = [1000.0]
    book = ArrivalBook(lambda: clock[0])
    for _ in range(20):  # 1 a second for 20 s, then 4 a second for 5 s
        book.observe(_entry(END, "main/chat"), "edge")
        clock[0] += 1.0
    for _ in range(20):
        book.observe(_entry(END, "main/chat"), "edge")
        clock[0] += 0.25
    host = "10.0.1.1:8000"
    assert book.completions(window=5.0)[host] == pytest.approx(4.0, rel=0.06)
    assert book.completions()[host] == pytest.approx(30 / ARRIVAL_WINDOW, rel=0.06)
