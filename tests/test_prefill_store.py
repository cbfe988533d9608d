"""Overflow's prefill fit kept in etcd (``signals.prefillrecord``, ``controlplane.prefillfits``):
the record and what does not parse, which fit a route continues from, the weight a compiled
route takes from a stored fit, and a fit written by one kvpilot's publisher (at its interval
and when it stops) read back by another's board through a real etcd."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
from harness.overflow import KINDS, TRUE_WEIGHT, compiled_arrivals
from harness.overflow import learned_fit as learned

from controlplane.etcd import EtcdClient, KeyValue
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd
from controlplane.mirror import StateChange, StateMirror
from controlplane.prefillfits import FITS_PREFIX, FitBoard, FitPublisher, fit_key
from signals.overflow import OverflowDecision
from signals.overflowff import ArrivalsDecision
from signals.overflowwork import PREFILL_WEIGHT
from signals.prefillfit import MIN_FIT_WINDOWS, RESTART_AFTER, PrefillFit
from signals.prefillrecord import (
    STORED_MAX_AGE,
    FitScope,
    StoredFit,
    fit_record,
    fit_scope,
    restore,
    seeded,
)

NOW = 1_800_000_000.0
PORTS = (8001, 8002, 8003, 8004)
ROUTE = "main/chat"
SCOPE = FitScope(("owned",), 8.0)
"""What ``harness.overflow.compiled_arrivals``' route is learned on: pool ``owned`` at 8."""


def stored(fit: PrefillFit | None = None, scope: FitScope = SCOPE, at: float = NOW) -> StoredFit:
    found = restore(fit_record(fit or learned(), scope, at, "a"))
    assert found is not None
    return found


# --------------------------------------------------------------------------- the record


def test_a_stored_fit_reads_back_as_it_was_written() -> None:
    fit = learned(12).take(3.0, 1000.0, 2000.0)  # one screened: the count goes along
    back = stored(fit)
    assert back.scope == SCOPE and back.at == NOW and back.replica == "a"
    assert back.fit.stored and not fit.stored
    assert back.fit == PrefillFit(**{**_fields(fit), "stored": True})
    assert back.fit.weight() == fit.weight() == pytest.approx(TRUE_WEIGHT, abs=1e-4)
    # Through JSON, as etcd holds it.
    again = restore(json.loads(json.dumps(fit_record(fit, SCOPE, NOW, "a"))))
    assert again == back
    # One interval added by this replica: no longer the stored one.
    assert not back.fit.add(12.0, 5000.0, 20000.0).stored


def _fields(fit: PrefillFit) -> dict[str, Any]:
    return {name: getattr(fit, name) for name in PrefillFit.__dataclass_fields__}


@pytest.mark.parametrize(
    "change",
    [
        {"oo": None},
        {"tt": float("nan")},
        {"at": "yesterday"},
        {"pp": -1.0},
        {"windows": -2.0},
        {"intervals": True},
        {"intervals": 2.5},
        {"screened": -1},
        {"in_row": "1"},
        {"pools": []},
        {"pools": ["owned", 3]},
        {"pools": "owned"},
        {"replica": None},
    ],
)
def test_a_record_that_kvpilot_did_not_write_is_not_taken(change: dict[str, Any]) -> None:
    body: dict[str, Any] = {**fit_record(learned(), SCOPE, NOW, "a"), **change}
    body = {name: value for name, value in body.items() if value is not None}
    assert restore(body) is None


def test_a_fit_learned_on_replicas_of_one_batch_size_has_that_scope() -> None:
    assert fit_scope(["owned", "big", "owned"], [32, 32, 31.96]) == FitScope(("big", "owned"), 32.0)
    assert fit_scope(["owned"], []) is None


# --------------------------------------------------------------------------- which fit goes on


def test_a_fresh_fit_continues_from_the_stored_one_of_its_scope_only() -> None:
    record = stored()
    assert seeded(PrefillFit(), record, SCOPE, NOW + 60) is record.fit
    # Learned on other pools, at another batch size, too long ago, or not known: its own.
    for scope in (FitScope(("other",), 8.0), FitScope(("owned",), 32.0), None):
        assert seeded(PrefillFit(), record, scope, NOW) == PrefillFit()
    assert seeded(PrefillFit(), record, SCOPE, NOW + STORED_MAX_AGE + 1) == PrefillFit()
    unsure = stored(learned(MIN_FIT_WINDOWS - 1))
    assert seeded(PrefillFit(), unsure, SCOPE, NOW) == PrefillFit()
    assert seeded(PrefillFit(), None, SCOPE, NOW) == PrefillFit()
    # A fit of its own, even one that cannot say yet, goes on.
    own = learned(3)
    assert seeded(own, record, SCOPE, NOW) is own
    # A fit that started again after intervals that did not fit: the engines changed since
    # whatever was stored.
    restarted = learned()
    for _ in range(RESTART_AFTER - 1):
        restarted = restarted.take(12.0, 100.0, 100.0)
    restarted = restarted.take(12.0, 100.0, 100.0)
    assert restarted.intervals == 1 and restarted.screened == RESTART_AFTER
    assert seeded(restarted, record, SCOPE, NOW) is restarted


def test_a_compiled_route_weighs_with_the_stored_fit_and_says_so() -> None:
    live: dict[str, Any] = {"kind_work": {ROUTE: KINDS}}
    cold = compiled_arrivals(PORTS, now=NOW, live=live)
    assert (cold.prefill_weight, cold.weight_source) == (PREFILL_WEIGHT, "default")
    assert cold.scope == SCOPE

    record = stored()
    warm = compiled_arrivals(PORTS, now=NOW, live={**live, "stored_fits": {ROUTE: record}})
    assert warm.weight_source == "stored"
    assert warm.prefill_weight == pytest.approx(TRUE_WEIGHT, abs=1e-4)
    assert warm.fit == record.fit and warm.scope == SCOPE
    assert warm.work == pytest.approx((100 + 300 + warm.prefill_weight * 3100) / 2, abs=0.01)
    assert "(stored, 8 intervals)" in warm.why
    # Stored for another batch size: not taken.
    other = stored(scope=FitScope(("owned",), 32.0))
    again = compiled_arrivals(PORTS, now=NOW, live={**live, "stored_fits": {ROUTE: other}})
    assert again.weight_source == "default"
    # A set weight still wins over a stored one.
    fixed = compiled_arrivals(
        PORTS, now=NOW, live={**live, "stored_fits": {ROUTE: record}}, prefillWeight=0.05
    )
    assert (fixed.prefill_weight, fixed.weight_source) == (0.05, "set")


# --------------------------------------------------------------------------- through etcd


def _decisions(fit: PrefillFit, scope: FitScope | None = SCOPE) -> dict[str, OverflowDecision]:
    return {ROUTE: OverflowDecision(arrivals=ArrivalsDecision(fit=fit, scope=scope))}


def _kv(body: bytes) -> KeyValue:
    return KeyValue(key=b"", value=body, create_revision=1, mod_revision=1, version=1, lease=0)


def test_the_board_keeps_what_etcd_holds_and_skips_what_does_not_parse(
    caplog: pytest.LogCaptureFixture,
) -> None:
    board = FitBoard()
    good = json.dumps(fit_record(learned(), SCOPE, NOW, "a")).encode()
    items: Mapping[str, KeyValue] = {
        fit_key(ROUTE): _kv(good),
        fit_key("main/other"): _kv(b'{"oo": 1}'),
        "objects/pools/owned": _kv(b"{}"),
    }
    board.on_change(StateChange(1, frozenset(items), full_resync=True), items)
    assert set(board.fits(NOW)) == {ROUTE}
    assert "main%2Fother does not parse" in caplog.text
    board.on_change(StateChange(2, frozenset({fit_key(ROUTE)}), full_resync=False), {})
    assert board.fits(NOW) == {}


@pytest.fixture
async def client(etcd: EmbeddedEtcd) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.endpoint]) as c:
        yield c


async def test_a_fit_one_kvpilot_learned_is_read_back_by_the_next(
    client: EtcdClient, etcd_prefix: str
) -> None:
    store = Store(client, etcd_prefix)
    decisions = _decisions(learned(9))
    clock = [NOW]
    first = FitPublisher(store, FitBoard(), lambda: decisions, "a", clock=lambda: clock[0])
    board = FitBoard()
    changed = asyncio.Event()
    mirror: StateMirror

    def on_change(change: StateChange) -> None:
        board.on_change(change, mirror.items)
        changed.set()

    async def until(holds: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not holds():
                changed.clear()
                await changed.wait()

    mirror = StateMirror(client, etcd_prefix, on_change)
    watching = asyncio.create_task(mirror.run())
    try:
        await mirror.wait_synced()
        # A fit that cannot say, a stored one not added to, one without a scope: not written.
        for fit, scope in ((learned(5), SCOPE), (stored().fit, SCOPE), (learned(9), None)):
            decisions = _decisions(fit, scope)
            await first.flush()
        assert first.writes == 0
        decisions = _decisions(learned(9))
        await first.flush()
        await first.flush()  # nothing learned since: nothing written
        assert first.writes == 1
        await until(lambda: ROUTE in board.stored)
        back = board.fits(NOW)[ROUTE]
        assert back.fit.stored and back.fit.intervals == 9 and back.scope == SCOPE
        assert back.replica == "a" and back.at == NOW

        # Stopped after learning more: the last batch is written on the way out.
        decisions = _decisions(learned(11))
        running = asyncio.create_task(first.run())
        await asyncio.sleep(0)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert first.writes == 2
        await until(lambda: board.stored[ROUTE].fit.intervals == 11)

        # The next kvpilot's route, fresh, continues from it.
        seeded_fit = seeded(PrefillFit(), board.fits(NOW)[ROUTE], SCOPE, NOW + 3600)
        assert seeded_fit.weight() == learned(11).weight()

        # A week on, the record is past its age: deleted with the next batch.
        clock[0] = NOW + STORED_MAX_AGE + 1
        later = FitPublisher(store, board, lambda: {}, "b", clock=lambda: clock[0])
        await later.flush()
        assert later.writes == 1
        await until(lambda: ROUTE not in board.stored)
        assert not [key for key in mirror.items if key.startswith(FITS_PREFIX)]
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
