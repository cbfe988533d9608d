"""The loop that holds virtual models' large-model shares: scores in from Envoys, thresholds
out as configuration.

One ``ShareController`` per virtual model with a ``share`` (``signals.difficultyshare``), and
with more than two targets one per target after the first (each holding the share of requests
for it and the later targets: its threshold is the scores' quantile there), fed by the
``ScoreBook``. Once a second the loop asks each for its decision and hands the set
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

from compiler.difficulty import step_keys, virtual_key
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
        self._members: dict[str, list[str]] = {}
        """Virtual model -> the keys of its controllers."""
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
        """One reported score, for each of its virtual model's controllers."""
        if report.score is None:
            return
        for key in self._members.get(report.key, ()):
            self.controllers[key].observe(report.at, report.score)

    def _sync(self) -> None:
        """A controller for each target after the first of each virtual model with shares,
        holding the share of requests for it and the later targets; a changed share or
        configured threshold starts it afresh."""
        wanted: dict[str, tuple[float, float]] = {}
        members: dict[str, list[str]] = {}
        for key, virtual in self.virtual_models().items():
            for step, step_key in zip(virtual.steps, step_keys(key, virtual), strict=True):
                if step.above is not None:
                    wanted[step_key] = (step.above, step.threshold)
                    members.setdefault(key, []).append(step_key)
        for key in set(self.controllers) - set(wanted):
            del self.controllers[key]
            self._settings.pop(key, None)
            self.threshold.remove(key)
            self.expected.remove(key)
        for key, settings in wanted.items():
            if self._settings.get(key) != settings:
                self.controllers[key] = ShareController(*settings)
                self._settings[key] = settings
        self._members = members

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
