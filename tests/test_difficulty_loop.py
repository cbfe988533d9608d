"""The share loop inside kvpilot: score log entries parsed, counted and fed to a controller per
virtual model, thresholds handed to the reconciler only when they move."""

from __future__ import annotations

from collections.abc import Mapping

from envoy.data.accesslog.v3 import accesslog_pb2
from harness.builders import policy, route

from controlplane.reconcile.difficulty import DifficultyLoop, virtual_models_of
from controlplane.reconcile.loop import Reconciler
from policies import RoutingPolicy, parse_object
from signals.difficultyshare import ShareDecision
from xdsserver.difficultylog import ScoreBook, parse
from xdsserver.snapshot import SnapshotCache


def entry(key: str, score: str, target: str, *, escalated: bool = False) -> object:
    log = accesslog_pb2.HTTPAccessLogEntry()
    fields = log.common_properties.metadata.filter_metadata["kvpilot.difficulty"]
    fields.update({"virtual": key, "score": score, "target": target, "source": "builtin"})
    log.common_properties.start_time.seconds = 100
    if escalated:
        log.response.response_headers["x-kvpilot-escalated"] = "true"
    return log


def virtual_policy() -> RoutingPolicy:
    document = policy(
        "main",
        10000,
        [
            route("small", name="small", match={"models": ["s"]}),
            route("large", name="large", match={"models": ["l"]}),
        ],
    )
    document["spec"]["virtualModels"] = [{"name": "auto", "small": "s", "large": "l"}]
    parsed = parse_object(document)
    assert isinstance(parsed, RoutingPolicy)
    return parsed


def test_a_score_log_entry_is_parsed_counted_and_handed_on() -> None:
    report = parse(entry("main/auto", "0.7500", "l", escalated=True))
    assert report is not None
    assert (report.key, report.score, report.target, report.escalated) == (
        "main/auto",
        0.75,
        "l",
        True,
    )
    assert report.at == 100
    assert parse(accesslog_pb2.HTTPAccessLogEntry()) is None
    book = ScoreBook()
    seen = []
    book.listeners.append(seen.append)
    book.observe(entry("main/auto", "0.1", "s"))
    book.observe(entry("main/auto", "", "s"))  # the fallback: no score
    book.observe(entry("main/auto", "0.95", "l", escalated=True))
    counts = book.totals["main/auto"]
    assert counts.targets == {"s": 2, "l": 1}
    assert counts.escalations == 1
    assert sum(counts.scores) == 2
    assert [r.score for r in seen] == [0.1, None, 0.95]


def test_the_loop_publishes_a_threshold_that_holds_the_share() -> None:
    book = ScoreBook()
    published: list[Mapping[str, ShareDecision]] = []
    now = [1000.0]
    loop = DifficultyLoop(
        book,
        lambda: virtual_models_of({"main": virtual_policy()}),
        published.append,
        clock=lambda: now[0],
    )
    assert loop.step() == {}  # no scores yet: the configured threshold stays
    for i in range(200):
        book.observe(_at(entry("main/auto", f"{i / 200:.4f}", "s"), now[0] - 1))
    decisions = loop.step()
    decision = decisions["main/auto"]
    # 20% of scores spread evenly over [0, 1) lie above 0.8.
    assert 0.79 <= decision.threshold <= 0.80
    assert abs(decision.expected - 20) <= 1
    assert published[-1] == decisions


def _at(log: object, seconds: float) -> object:
    log.common_properties.start_time.seconds = int(seconds)  # type: ignore[attr-defined]
    return log


async def test_the_reconciler_rebuilds_for_a_moved_threshold_only() -> None:
    reconciler = Reconciler(SnapshotCache())
    reconciler.difficulty = {
        "main/auto": ShareDecision(threshold=0.8, tie=0.0, expected=20.0, samples=500)
    }
    # The same threshold with another expected share and sample count: nothing to push.
    reconciler.set_difficulty(
        {"main/auto": ShareDecision(threshold=0.8, tie=0.0, expected=20.6, samples=530)}
    )
    assert not reconciler.pending_rebuild
    assert reconciler.difficulty["main/auto"].samples == 530
    reconciler.set_difficulty(
        {"main/auto": ShareDecision(threshold=0.75, tie=0.0, expected=20.0, samples=540)}
    )
    assert reconciler.pending_rebuild
