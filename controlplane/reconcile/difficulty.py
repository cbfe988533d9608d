"""The loop that holds virtual models' large-model shares: scores in from Envoys, thresholds
out as configuration.

One ``ShareController`` per virtual model with a ``share`` (``signals.difficultyshare``),
fed by the ``ScoreBook``. Once a second the loop asks each for its decision and hands the set
to the reconciler, which rebuilds like a telemetry change when a threshold moved (route
configuration only, at most once per push interval). The lag from a change of traffic mix to
the new threshold in every Envoy is about two seconds: the log's 0.25 s flush, this loop's
interval, and one push.

Each kvpilot replica learns from the Envoys connected to it and holds their share; replicas
do not pool their scores (each sees a sample of the same traffic when Envoys spread evenly).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Gauge

from compiler.difficulty import virtual_key
from policies.models import RoutingPolicy, VirtualModel
from signals.difficultyshare import ShareController, ShareDecision
from xdsserver.difficultylog import ScoreBook, ScoreReport

log = logging.getLogger(__name__)


class DifficultyLoop:
    """Keeps a share controller per virtual model and publishes their thresholds."""

    def __init__(
        self,
        book: ScoreBook,
        virtual_models: Callable[[], Mapping[str, VirtualModel]],
        publish: Callable[[Mapping[str, ShareDecision]], None],
        *,
        interval: float = 1.0,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.virtual_models = virtual_models
        """The current virtual models with a share, by ``policy/name``."""
        self.publish = publish
        self.interval = interval
        self.clock = clock
        self.controllers: dict[str, ShareController] = {}
        self._settings: dict[str, tuple[float, float]] = {}
        registry = registry if registry is not None else CollectorRegistry()
        self.threshold = Gauge(
            "kvpilot_virtual_model_threshold",
            "Score above which a virtual model's requests go to the large model.",
            ["virtual_model"],
            registry=registry,
        )
        self.expected = Gauge(
            "kvpilot_virtual_model_large_share",
            "Percent of recent scores the threshold in force sends to the large model (before "
            "each Envoy's cap and floor).",
            ["virtual_model"],
            registry=registry,
        )
        book.listeners.append(self.observe)

    def observe(self, report: ScoreReport) -> None:
        """One reported score."""
        controller = self.controllers.get(report.key)
        if controller is not None and report.score is not None:
            controller.observe(report.at, report.score)

    def _sync(self) -> None:
        """A controller for each virtual model with a share; a changed share or configured
        threshold starts it afresh."""
        current = self.virtual_models()
        for key in set(self.controllers) - set(current):
            del self.controllers[key]
            self._settings.pop(key, None)
            self.threshold.remove(key)
            self.expected.remove(key)
        for key, virtual in current.items():
            if virtual.share is None:
                continue
            settings = (virtual.share, virtual.threshold)
            if self._settings.get(key) != settings:
                self.controllers[key] = ShareController(virtual.share, virtual.threshold)
                self._settings[key] = settings

    def step(self) -> dict[str, ShareDecision]:
        """One decision round; returns the decisions published."""
        self._sync()
        now = self.clock()
        decisions = {}
        for key, controller in self.controllers.items():
            decision = controller.decide(now)
            if decision.samples:
                decisions[key] = decision
            self.threshold.labels(key).set(decision.threshold)
            self.expected.labels(key).set(decision.expected)
        self.publish(decisions)
        return decisions

    async def run(self) -> None:
        """Decide every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.step()
            except Exception:
                log.exception("virtual model thresholds not updated this round")


def virtual_models_of(policies: Mapping[str, RoutingPolicy]) -> dict[str, VirtualModel]:
    """Virtual models of validated RoutingPolicies, by ``policy/name``."""
    return {
        virtual_key(name, virtual.name): virtual
        for name, policy in policies.items()
        for virtual in policy.spec.virtual_models
    }
