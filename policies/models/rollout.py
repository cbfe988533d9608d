"""A Rollout's spec: the route tier whose weights it moves, its steps, and the analysis that
decides whether each step holds."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from policies.models.fields import Duration, Model, Name


class RolloutTarget(Model):
    """The route tier whose pool weights a rollout changes."""

    policy: Name = Field(description="Name of the RoutingPolicy.")
    route: Name = Field(description="Name of the route within that policy.")
    tier: int = Field(
        0, ge=0, le=7, description="Index of the failover tier whose split changes. Default: 0."
    )


class RolloutStep(Model):
    """One step of weight, held until its minimum duration and requests have passed and the
    analysis found nothing wrong."""

    weight: int | None = Field(
        None,
        ge=0,
        le=100,
        description="The canary pool's share of the tier, in percent; the stable pool gets the "
        "rest. Give this or 'weights'.",
    )
    weights: dict[Name, Annotated[int, Field(ge=0, le=100)]] | None = Field(
        None,
        description="Every pool's share of the tier at this step, in percent, adding up to "
        "100 (a set of pool weights moving to another). Give this or 'weight'.",
    )
    min_duration: Duration = Field(
        60.0, description="Least time the step is held before the next one. Default: 60s."
    )
    min_requests: int = Field(
        0,
        ge=0,
        description="Least requests the canary must have answered during the step before the "
        "next one. Default: 0.",
    )


RolloutMetric = Literal["errorRate", "ttfb", "latency"]
"""``errorRate``: 5xx answers over requests; ``ttfb``: time from the request reaching the
replica to its first response byte (time to first token for a streamed completion);
``latency``: time to the last response byte."""


class AnalysisRule(Model):
    """A check on the canary's live numbers during every step."""

    name: str = Field(
        "", max_length=63, description="Label shown in status. Default: the metric's name."
    )
    metric: RolloutMetric | None = Field(
        None,
        description="A data-plane metric measured by the Envoys themselves, per pool: "
        "errorRate (5xx answers / requests, 0-1), ttfb (time to first byte, seconds) or "
        "latency (time to last byte, seconds). Give this or 'query'.",
    )
    percentile: float = Field(
        95.0, gt=0, lt=100, description="Percentile of ttfb or latency. Default: 95."
    )
    max: float | None = Field(
        None,
        ge=0,
        description="Fail when the canary's value (or the query's) is above this: a fraction "
        "for errorRate, seconds for ttfb and latency.",
    )
    max_ratio: float | None = Field(
        None,
        gt=0,
        description="Fail when the canary's value is above this multiple of the stable "
        "pool's, measured over the same step (for errorRate: above the stable rate times this, "
        "plus 1 percentage point).",
    )
    query: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A PromQL query against analysis.prometheus instead of a data-plane "
        "metric; its value is compared with 'max'. '{canary}', '{stable}', '{route}' and "
        "'{interval}' (the step's age, e.g. '30s') are filled in.",
    )

    @property
    def label(self) -> str:
        """The rule's name in status and history."""
        if self.name:
            return self.name
        if self.metric in ("ttfb", "latency"):
            return f"{self.metric} p{self.percentile:g}"
        return self.metric or "query"


class PrometheusSource(Model):
    """A Prometheus server that query rules read."""

    url: str = Field(pattern=r"^https?://", description="Base URL, e.g. http://prometheus:9090.")
    timeout: Duration = Field(5.0, description="Query timeout. Default: 5s.")


def _default_rules() -> list[AnalysisRule]:
    return [AnalysisRule(metric="errorRate", max=0.05)]


class Analysis(Model):
    """How each step's verdict is reached."""

    min_sample: int = Field(
        50,
        ge=1,
        description="Requests the canary (and, for relative rules, the stable pool) must have "
        "answered during the step before any verdict. Default: 50.",
    )
    interval: Duration = Field(1.0, description="How often the rules are evaluated. Default: 1s.")
    rules: list[AnalysisRule] = Field(
        default_factory=_default_rules,
        description="Checks that must all pass. Default: errorRate at most 5%.",
    )
    prometheus: PrometheusSource | None = Field(
        None, description="Prometheus server for query rules. Default: none."
    )


FailureAction = Literal["rollback", "pause"]


class RolloutSpec(Model):
    """Move a route tier's weight between pools step by step, watching the data plane."""

    target: RolloutTarget = Field(description="Which route tier.")
    stable: Name | None = Field(
        None, description="The pool weight moves away from (steps with 'weight')."
    )
    canary: Name | None = Field(None, description="The pool weight moves to (steps with 'weight').")
    steps: list[RolloutStep] = Field(
        min_length=1, max_length=100, description="Steps in order; the last is the end state."
    )
    fleets: list[Name] = Field(
        default_factory=list,
        description="Canary fleets, which take every step first: their Envoys get a step's "
        "weights while every other fleet keeps the weights of the step before, until the "
        "step has been held and has passed its analysis on the canary fleets' traffic alone; "
        "then the step reaches every fleet and is held and analysed again. Default: none "
        "(every fleet at once).",
    )
    analysis: Analysis = Field(
        default_factory=Analysis, description="Checks applied at every step."
    )
    on_failure: FailureAction = Field(
        "rollback",
        description="What a failed check does: rollback (back to the weights the rollout "
        "started from) or pause (hold the current step for a person). Default: rollback.",
    )

    def problems(self) -> list[tuple[str, str]]:
        """Consistency problems between fields, each as (path under spec, sentence)."""
        out: list[tuple[str, str]] = []
        uses_weight = False
        previous: int | None = None
        for index, step in enumerate(self.steps):
            path = f"steps[{index}]"
            if (step.weight is None) == (step.weights is None):
                out.append((path, "give either 'weight' (the canary's percent) or 'weights'"))
                continue
            if step.weight is not None:
                uses_weight = True
                if previous is not None and step.weight <= previous:
                    out.append(
                        (
                            f"{path}.weight",
                            f"steps must raise the canary's weight: {step.weight} does not "
                            f"come after {previous}",
                        )
                    )
                previous = step.weight
            elif step.weights is not None and sum(step.weights.values()) != 100:
                out.append(
                    (
                        f"{path}.weights",
                        f"the weights add up to {sum(step.weights.values())}, not 100",
                    )
                )
        duplicates = sorted({f for f in self.fleets if self.fleets.count(f) > 1})
        if duplicates:
            out.append(("fleets", f"fleet {duplicates[0]!r} is named twice"))
        if uses_weight:
            for field_name in ("stable", "canary"):
                if getattr(self, field_name) is None:
                    out.append((field_name, "steps with 'weight' need a stable and a canary pool"))
            if self.stable is not None and self.stable == self.canary:
                out.append(("canary", "the canary pool must differ from the stable pool"))
        for index, rule in enumerate(self.analysis.rules):
            path = f"analysis.rules[{index}]"
            if (rule.metric is None) == (rule.query is None):
                out.append((path, "give either 'metric' or 'query'"))
            elif rule.query is not None:
                if rule.max is None:
                    out.append((f"{path}.max", "a query rule needs 'max'"))
                if rule.max_ratio is not None:
                    out.append((f"{path}.maxRatio", "a query rule compares with 'max' only"))
                if self.analysis.prometheus is None:
                    out.append((f"{path}.query", "a query rule needs analysis.prometheus.url"))
            elif rule.max is None and rule.max_ratio is None:
                out.append((path, "give 'max', 'maxRatio' or both"))
        return out

    def step_weights(self, index: int) -> dict[str, int]:
        """Every pool's weight (percent) at step ``index``."""
        step = self.steps[index]
        if step.weights is not None:
            return dict(step.weights)
        assert step.weight is not None and self.stable and self.canary
        return {self.stable: 100 - step.weight, self.canary: step.weight}

    def pools(self) -> list[str]:
        """Every pool the rollout moves weight between, in first-mention order."""
        names: dict[str, None] = {}
        for field_name in (self.stable, self.canary):
            if field_name:
                names[field_name] = None
        for step in self.steps:
            names.update(dict.fromkeys(step.weights or {}))
        return list(names)
