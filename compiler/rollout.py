"""What a Rollout means, without I/O: its references, its per-pool signals and its verdicts.

The controller (``controlplane.rollouts``) reads and writes etcd; everything it decides comes
from here, so each decision can be checked on plain numbers:

- ``reference_errors``: the rollout names a policy, route, tier and pools that exist;
- ``PoolSignals``: one pool's request count, 5xx count and latency histograms, as the Envoys
  measured them. Counters only grow, so two snapshots subtract to the numbers of the time in
  between (a step), and the snapshots of several kvpilot replicas add up;
- ``evaluate``: the rules of a step against the canary's and the stable pool's numbers.

Latencies go into fixed log-spaced buckets (20% wide), so histograms from every Envoy and every
replica add bucket by bucket, and a percentile is read back within a bucket's width, as
Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from compiler.fleets import fleet_names
from policies.models import AnalysisRule, Rollout
from policies.names import cluster_name
from policies.validate import FieldError
from signals.state import PolicyState

BUCKET_BOUNDS: tuple[float, ...] = tuple(0.0005 * 1.2**k for k in range(80))
"""Upper bounds of the latency buckets, in seconds: 0.5 ms to about 1,000 s, each 20% wider
than the one before. A value above the last bound counts in an overflow bucket."""

COMMANDS = ("pause", "resume", "abort", "promote")
"""What a person can ask of a running rollout (REST ``POST /v1/rollouts/{name}/{command}``)."""
PHASES = ("Pending", "Progressing", "Paused", "Succeeded", "RolledBack", "Aborted", "Failed")
"""A rollout's phases; the last four are final."""
TERMINAL = PHASES[3:]

ERROR_RATE_SLACK = 0.01
"""An errorRate ``maxRatio`` allows this much on top of the stable rate times the ratio, so a
stable pool with no errors at all does not turn one canary error into a failure."""


def reference_errors(rollout: Rollout, state: PolicyState) -> list[FieldError]:
    """Problems with what a rollout refers to in ``state``, each with its field path."""
    spec = rollout.spec
    policy = state.policies.get(spec.target.policy)
    if policy is None:
        return [
            FieldError("spec.target.policy", f"RoutingPolicy {spec.target.policy!r} does not exist")
        ]
    route = next((r for r in policy.spec.routes if r.name == spec.target.route), None)
    if route is None:
        known = ", ".join(repr(r.name) for r in policy.spec.routes)
        return [
            FieldError(
                "spec.target.route",
                f"policy {spec.target.policy!r} has no route {spec.target.route!r} "
                f"(it has {known})",
            )
        ]
    if spec.target.tier >= len(route.tiers):
        return [
            FieldError(
                "spec.target.tier",
                f"route {spec.target.route!r} has {len(route.tiers)} tier(s); tier "
                f"{spec.target.tier} does not exist",
            )
        ]
    errors = []
    in_tier = {target.pool for target in route.tiers[spec.target.tier].pools}
    elsewhere = {
        target.pool
        for index, tier in enumerate(route.tiers)
        if index != spec.target.tier
        for target in tier.pools
    }
    if spec.stable is not None and spec.stable not in in_tier:
        errors.append(
            FieldError(
                "spec.stable",
                f"pool {spec.stable!r} is not in tier {spec.target.tier} of route "
                f"{spec.target.route!r}",
            )
        )
    named = [("spec.stable", spec.stable), ("spec.canary", spec.canary)]
    for index, step in enumerate(spec.steps):
        named.extend((f"spec.steps[{index}].weights.{pool}", pool) for pool in step.weights or {})
    for path, pool in named:
        if pool is None:
            continue
        if pool not in state.pools:
            errors.append(FieldError(path, f"pool {pool!r} does not exist"))
        elif pool in elsewhere:
            errors.append(
                FieldError(path, f"pool {pool!r} is in another tier of route {route.name!r}")
            )
        elif state.pools[pool].spec.external:
            errors.append(
                FieldError(
                    path,
                    f"pool {pool!r} is an external provider; a rollout moves weight between "
                    "replica pools of one cluster",
                )
            )
    served = fleet_names(state) if "*" in policy.spec.fleets else policy.spec.fleets
    for index, fleet in enumerate(spec.fleets):
        if fleet not in served:
            errors.append(
                FieldError(
                    f"spec.fleets[{index}]",
                    f"policy {spec.target.policy!r} serves no fleet {fleet!r} (it serves "
                    f"{', '.join(repr(f) for f in served)}); name a fleet of its Envoys",
                )
            )
    for name, other in state.rollouts.items():
        if name != rollout.metadata.name and other.spec.target == spec.target:
            errors.append(
                FieldError(
                    "spec.target",
                    f"Rollout {name!r} already changes this tier; delete it first",
                )
            )
    return errors


def target_cluster(rollout: Rollout) -> str:
    """The Envoy cluster of the route a rollout changes."""
    return cluster_name(rollout.spec.target.policy, rollout.spec.target.route)


# --------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------


def bucket_index(seconds: float) -> int:
    """The bucket a latency falls in (``len(BUCKET_BOUNDS)`` is the overflow bucket)."""
    return bisect.bisect_left(BUCKET_BOUNDS, seconds)


@dataclass(slots=True)
class PoolSignals:
    """One pool's upstream attempts as Envoys logged them: counters that only grow."""

    requests: int = 0
    errors: int = 0
    """Attempts answered with a 5xx status, or with no status at all (reset, timeout)."""
    ttfb: dict[int, int] = field(default_factory=dict)
    """Time to first byte: bucket index -> attempts."""
    latency: dict[int, int] = field(default_factory=dict)
    """Time to last byte: bucket index -> attempts."""

    def observe(self, status: int, ttfb: float | None, latency: float | None) -> None:
        """Count one attempt."""
        self.requests += 1
        if status == 0 or status >= 500:
            self.errors += 1
        if ttfb is not None:
            index = bucket_index(ttfb)
            self.ttfb[index] = self.ttfb.get(index, 0) + 1
        if latency is not None:
            index = bucket_index(latency)
            self.latency[index] = self.latency.get(index, 0) + 1

    def add(self, other: PoolSignals) -> None:
        """Fold ``other`` into this one (another Envoy, another replica)."""
        self.requests += other.requests
        self.errors += other.errors
        for mine, theirs in ((self.ttfb, other.ttfb), (self.latency, other.latency)):
            for index, count in theirs.items():
                mine[index] = mine.get(index, 0) + count

    def since(self, earlier: PoolSignals) -> PoolSignals:
        """What happened between ``earlier`` and this snapshot of the same counters."""
        return PoolSignals(
            requests=max(0, self.requests - earlier.requests),
            errors=max(0, self.errors - earlier.errors),
            ttfb=_minus(self.ttfb, earlier.ttfb),
            latency=_minus(self.latency, earlier.latency),
        )

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def percentile(self, metric: Literal["ttfb", "latency"], percentile: float) -> float | None:
        """The ``percentile`` (0-100) of a latency, in seconds; None without samples."""
        return quantile(self.ttfb if metric == "ttfb" else self.latency, percentile / 100)

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "ttfb": {str(k): v for k, v in sorted(self.ttfb.items())},
            "latency": {str(k): v for k, v in sorted(self.latency.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PoolSignals:
        """Read ``as_json`` output; anything malformed raises ``ValueError``."""
        try:
            return cls(
                requests=int(data.get("requests", 0)),
                errors=int(data.get("errors", 0)),
                ttfb={int(k): int(v) for k, v in dict(data.get("ttfb", {})).items()},
                latency={int(k): int(v) for k, v in dict(data.get("latency", {})).items()},
            )
        except (TypeError, AttributeError) as error:
            raise ValueError(f"not a pool signals record: {error}") from None


def _minus(later: Mapping[int, int], earlier: Mapping[int, int]) -> dict[int, int]:
    return {k: v - earlier.get(k, 0) for k, v in later.items() if v - earlier.get(k, 0) > 0}


def quantile(buckets: Mapping[int, int], q: float) -> float | None:
    """The ``q`` quantile (0-1) of a bucketed histogram, interpolated within its bucket."""
    total = sum(buckets.values())
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index in sorted(buckets):
        count = buckets[index]
        if seen + count >= rank:
            upper = BUCKET_BOUNDS[min(index, len(BUCKET_BOUNDS) - 1)]
            lower = BUCKET_BOUNDS[index - 1] if 0 < index <= len(BUCKET_BOUNDS) else 0.0
            return lower + (upper - lower) * ((rank - seen) / count)
        seen += count
    return BUCKET_BOUNDS[-1]


def merge(records: Iterable[Mapping[str, PoolSignals]]) -> dict[str, PoolSignals]:
    """Pool name -> signals summed over several sources."""
    out: dict[str, PoolSignals] = {}
    for record in records:
        for pool, signals in record.items():
            out.setdefault(pool, PoolSignals()).add(signals)
    return out


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------

Outcome = Literal["pass", "fail", "waiting", "skipped"]


@dataclass(frozen=True, slots=True)
class RuleResult:
    """One rule's outcome on one step's numbers."""

    rule: str
    outcome: Outcome
    canary: float | None = None
    stable: float | None = None
    limit: float | None = None
    message: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "outcome": self.outcome,
            "canary": _rounded(self.canary),
            "stable": _rounded(self.stable),
            "limit": _rounded(self.limit),
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    """All rules of a step: failed if any failed, passed if none is still waiting."""

    results: tuple[RuleResult, ...]
    canary: PoolSignals
    stable: PoolSignals

    @property
    def outcome(self) -> Outcome:
        outcomes = {result.outcome for result in self.results}
        if "fail" in outcomes:
            return "fail"
        if "waiting" in outcomes:
            return "waiting"
        return "pass"

    def as_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "canary": {"requests": self.canary.requests, "errors": self.canary.errors},
            "stable": {"requests": self.stable.requests, "errors": self.stable.errors},
            "rules": [result.as_json() for result in self.results],
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 6)


def evaluate(
    rules: Sequence[AnalysisRule],
    *,
    min_sample: int,
    canary: PoolSignals,
    stable: PoolSignals,
    stable_weight: int,
    queried: Mapping[int, float | None] | None = None,
) -> Verdict:
    """The verdict of ``rules`` on one step's numbers.

    A rule waits until the canary has answered ``min_sample`` attempts in the step, and a
    relative rule also until the stable pool has; with no weight left on the stable pool a
    relative rule has nothing to compare with and is skipped. ``queried`` holds the values of
    query rules by rule index (None: the query returned nothing yet).
    """
    results = []
    for index, rule in enumerate(rules):
        label = rule.label
        if rule.query is not None:
            value = (queried or {}).get(index)
            if value is None:
                results.append(RuleResult(label, "waiting", message="the query returned no value"))
            else:
                failed = rule.max is not None and value > rule.max
                results.append(
                    RuleResult(label, "fail" if failed else "pass", value, None, rule.max)
                )
            continue
        if canary.requests < min_sample:
            results.append(
                RuleResult(
                    label,
                    "waiting",
                    message=f"{canary.requests} of {min_sample} canary requests",
                )
            )
            continue
        mine = _measure(rule, canary)
        theirs = _measure(rule, stable) if stable.requests else None
        limits: list[float] = []
        if rule.max is not None:
            limits.append(rule.max)
        if rule.max_ratio is not None:
            if stable_weight == 0:
                if rule.max is None:
                    results.append(
                        RuleResult(label, "skipped", mine, message="no stable traffic to compare")
                    )
                    continue
            elif stable.requests < min_sample or theirs is None:
                results.append(
                    RuleResult(
                        label,
                        "waiting",
                        mine,
                        message=f"{stable.requests} of {min_sample} stable requests",
                    )
                )
                continue
            else:
                relative = theirs * rule.max_ratio
                if rule.metric == "errorRate":
                    relative += ERROR_RATE_SLACK
                limits.append(relative)
        limit = min(limits)
        failed = mine is not None and mine > limit
        results.append(RuleResult(label, "fail" if failed else "pass", mine, theirs, limit))
    return Verdict(tuple(results), canary, stable)


def _measure(rule: AnalysisRule, signals: PoolSignals) -> float | None:
    if rule.metric == "errorRate":
        return signals.error_rate
    if rule.metric in ("ttfb", "latency"):
        return signals.percentile(rule.metric, rule.percentile)
    return None
