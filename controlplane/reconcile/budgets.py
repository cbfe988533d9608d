"""Budget verdicts: after each batch of usage entries (and at every window's end), sum the
fleet's spend for every Budget and tell the reconciler which are spent; the reconciler pushes
the blocks to every Envoy as route entries (``xdsserver.translate.budgets``).

Each replica decides for itself from the same inputs (its own counters from memory, the
others' from etcd), so every replica pushes the same blocks to its Envoys; no leader is
needed. A replica sees its own Envoys' spend within one access log flush, and another
replica's within that replica's spend interval plus etcd's watch (docs/cost.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping

from controlplane.etcd import KeyValue
from controlplane.reconcile.loop import Reconciler
from controlplane.spend import fleet_spend
from signals import PolicyState
from signals.budgets import over_budgets
from signals.spend import Ledger

log = logging.getLogger(__name__)

RECHECK_INTERVAL = 0.25
"""Seconds between checks without new entries from this replica's Envoys: other replicas'
spend arrives through etcd."""


class BudgetWatcher:
    """Keeps ``Reconciler.over_budget`` in line with the fleet's spend."""

    def __init__(
        self,
        reconciler: Reconciler,
        ledger: Ledger,
        items: Callable[[], Mapping[str, KeyValue]],
        replica_id: str,
        *,
        clock: Callable[[], float] = time.time,
        recheck: float = RECHECK_INTERVAL,
    ) -> None:
        self.reconciler = reconciler
        self.ledger = ledger
        self.items = items
        self.replica_id = replica_id
        self.clock = clock
        self.recheck = recheck
        self._poked = asyncio.Event()
        reconciler.budget_verdicts = self.verdicts

    def poke(self) -> None:
        """New usage arrived: check soon (called after each batch of access log entries)."""
        self._poked.set()

    def verdicts(self, state: PolicyState) -> dict[str, float]:
        """The spent budgets of ``state`` now (budget name -> its window's end)."""
        if not state.budgets:
            return {}
        at = self.clock()
        tenants = {budget.spec.tenant for budget in state.budgets.values()}
        return over_budgets(
            state.budgets,
            lambda window: fleet_spend(
                self.items(), self.ledger, self.replica_id, window, at, tenants
            ),
            at,
        )

    def check(self) -> dict[str, float]:
        """The spent budgets now, handed to the reconciler."""
        state = self.reconciler.state
        over = self.verdicts(state) if state is not None else {}
        if over != self.reconciler.over_budget:
            log.info("budgets spent now: %s", ", ".join(sorted(over)) or "none")
        self.reconciler.set_over_budget(over)
        return over

    async def run(self) -> None:
        """Check after each poke, at each spent window's end and every ``recheck`` seconds."""
        over: dict[str, float] = {}
        while True:
            wake = min(over.values(), default=math.inf) - self.clock()
            try:
                async with asyncio.timeout(max(0.0, min(wake, self.recheck))):
                    await self._poked.wait()
            except TimeoutError:
                pass
            self._poked.clear()
            try:
                over = self.check()
            except Exception:
                log.exception("budget check failed; the last verdicts stay")
