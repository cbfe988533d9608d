"""Service classes: how a RoutingPolicy sorts requests into classes with objectives and
budgets, and what it does with each class when a pool is saturated."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from policies.models.fields import Duration, HeaderName, Model, Name
from policies.models.route import HeaderMatch

ClassAction = Literal["admit", "shed", "queue", "divert"]


DEFAULT_TENANT_HEADER = "x-tenant-id"
"""The header that names a tenant unless a policy's service classes name another: class
matches, class budgets, token accounting and spend budgets all read it."""


class ClassMatch(Model):
    """Which requests belong to a class. All given conditions must hold."""

    headers: list[HeaderMatch] = Field(
        default_factory=list,
        description="Exact header matches, for example x-priority: batch. Default: none.",
    )
    tenants: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list,
        description="Values of the tenant header (serviceClasses.tenantHeader) whose requests "
        "belong to this class. Default: any tenant.",
    )

    @model_validator(mode="after")
    def _not_empty(self) -> ClassMatch:
        if not self.headers and not self.tenants:
            raise ValueError("a class match needs headers or tenants; leave match out instead")
        return self


class ClassObjective(Model):
    """What the class is promised while the fleet has room."""

    ttft: Duration = Field(
        description="Time-to-first-token target (time to first byte for non-streaming "
        "requests), for example '1s' for interactive chat or '60s' for batch. Requests that "
        "meet it count as goodput."
    )


class ClassBudget(Model):
    """A token bucket for the whole class on each Envoy, shared fairly among its tenants."""

    requests: int = Field(ge=1, description="Requests the class may send per unit.")
    unit: Literal["second", "minute", "hour"] = Field(
        "second", description="Time unit. Default: second."
    )
    burst: int | None = Field(None, ge=1, description="Bucket size. Default: equal to requests.")
    tenant_share: int = Field(
        100,
        ge=1,
        le=100,
        description="Largest share of the class budget one tenant (a value of the tenant "
        "header) may take, in percent. Each tenant gets a bucket of this share of the budget; "
        "a request spends from its tenant's bucket and from the class bucket. Default: 100.",
    )


class ClassQueue(Model):
    """Where a queued class waits: in each Envoy, at most ``concurrency`` of its requests at
    the pool at once and ``size`` more waiting for one of those places (Envoy's circuit
    breakers on a cluster of the class's own); past that Envoy answers 503 at once."""

    concurrency: int = Field(
        8,
        ge=1,
        le=100_000,
        description="Requests of the class in flight to the pool at once, per Envoy: a "
        "connection limit, since with http1 each request holds a connection of its own. Envoy "
        "lets each worker thread open one connection past the limit, so the bound is at "
        "least the number of workers. Default: 8.",
    )
    size: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="Requests that wait in each Envoy for a place; more overflow with 503. "
        "Default: 1000.",
    )


class ServiceClass(Model):
    """A class of traffic with an objective and what to do when the fleet cannot meet it.

    While the route's pool is saturated (``serviceClasses.saturation``), kvpilot restricts the
    lowest classes first, in steps, and gives them back in the reverse order once the pool
    has recovered; classes whose action is ``admit`` are never restricted.
    """

    name: Name = Field(description="Class name, unique within the policy.")
    match: ClassMatch | None = Field(
        None,
        description="Which requests belong to the class. Classes are tried in order; a "
        "request that matches none takes its route's serviceClass (or defaultClass). "
        "Default: none (only routes and defaultClass name the class).",
    )
    objective: ClassObjective = Field(description="Time-to-first-token target.")
    when_saturated: ClassAction = Field(
        "admit",
        description="What Envoy does with the class's requests while the pool is saturated: "
        "admit (keep serving, queueing at the replicas), shed (answer 429 with Retry-After, "
        "in OpenAI's error format), queue (hold them in Envoy, see queue) or divert (send "
        "them to the route named by divertTo, for example a lower tier or an external "
        "provider). Default: admit.",
    )
    retry_after: Duration = Field(
        10.0,
        description="Retry-After sent with shed requests, rounded up to whole seconds. "
        "Default: 10s.",
    )
    divert_to: Name | None = Field(
        None,
        description="Route of this policy that takes diverted requests (whenSaturated: "
        "divert). Default: none.",
    )
    queue: ClassQueue | None = Field(
        None,
        description="Bounds of the queue in Envoy (whenSaturated: queue). Default: "
        "concurrency 8, size 1000.",
    )
    budget: ClassBudget | None = Field(
        None, description="Request budget of the class, fair among tenants. Default: none."
    )

    @model_validator(mode="after")
    def _check(self) -> ServiceClass:
        if self.queue is not None and self.when_saturated != "queue":
            raise ValueError("queue applies only with whenSaturated 'queue'")
        if self.when_saturated == "divert" and self.divert_to is None:
            raise ValueError("whenSaturated 'divert' needs divertTo: the route that takes them")
        if self.divert_to is not None and self.when_saturated != "divert":
            raise ValueError("divertTo applies only with whenSaturated 'divert'")
        return self


TTFT_SHARE = 0.5
"""Share of the most important class's TTFT objective that the pool's mean time to first
token may reach before the pool counts as saturated (``Saturation.ttft``'s default)."""


class Saturation(Model):
    """When a pool counts as saturated, from its live telemetry (``Pool.spec.telemetry``).

    Pressure is the largest of the pool's mean time to first token, queue, KV-cache use and
    pending tokens, each divided by its bound here: 1.0 means saturated. The time to first
    token is what the objectives promise, and long prompts prefilling beside short ones slow
    it well before any queue forms, so its bound follows the most important class's
    objective. While pressure is at or above ``high`` and not falling, kvpilot restricts
    (sheds, queues or diverts) at once the share of the lowest restricted class that the
    excess over ``high`` implies (1.5 restricts half of the class, 2 all of it), and gives
    one step back while it is at or below ``low``: between the two nothing moves.
    """

    ttft: Duration | None = Field(
        None,
        gt=0,
        description="Mean time to first token on the pool's replicas (as the engines report "
        "it, all classes together) at which the pool is saturated. Default: half the "
        "objective of the most important class: the slowest of its requests cross the "
        "objective about when the mean crosses half of it.",
    )
    queue: float = Field(
        4.0,
        gt=0,
        description="Mean requests waiting per replica at which the pool is saturated. Default: 4.",
    )
    kv_cache: float = Field(
        0.95, gt=0, le=1, description="Mean KV-cache use that saturates the pool. Default: 0.95."
    )
    pending_tokens: float | None = Field(
        None,
        gt=0,
        description="Mean tokens admitted but not yet processed per replica that saturate the "
        "pool. Default: not used.",
    )
    busiest: int | None = Field(
        None,
        ge=1,
        le=100,
        description="Percent of the replicas, the busiest by each signal, that the queue, "
        "KV-cache and pending-token means are taken over: 25 reads each on the busiest "
        "quarter. With session affinity a replica may carry half again the mean load "
        "(bounded load), and its sessions wait while the pool mean still has room. The "
        "time to first token is always the pool mean: a replica's includes the long "
        "prompts' own prefill. Default: every replica (the pool mean).",
    )
    high: float = Field(
        1.0,
        gt=0,
        description="Pressure at which more is restricted: the excess over it, as a share "
        "of the class (at least one step). Default: 1.0.",
    )
    low: float = Field(
        0.5, ge=0, description="Pressure at or below which a step is given back. Default: 0.5."
    )
    step: int = Field(
        25,
        ge=1,
        le=100,
        description="Share of a class's requests given back at a time, and the unit in "
        "which shares are restricted, in percent. Default: 25.",
    )
    shed_interval: Duration = Field(
        1.0, description="Least time between two restrictions. Default: 1s."
    )
    recover_interval: Duration = Field(
        3.0,
        description="Least time between a change and a step given back; longer than "
        "shedInterval so a recovering pool does not flap. Default: 3s.",
    )

    @model_validator(mode="after")
    def _band(self) -> Saturation:
        if self.low >= self.high:
            raise ValueError("saturation low must be below high (the hysteresis band)")
        return self


class ServiceClasses(Model):
    """Classes of service of a policy's routes, most important first."""

    classes: list[ServiceClass] = Field(
        min_length=1, max_length=8, description="The classes, most important first."
    )
    default_class: Name | None = Field(
        None,
        description="Class of requests that no class matches and whose route names none. "
        "Default: the first class.",
    )
    tenant_header: HeaderName = Field(
        DEFAULT_TENANT_HEADER,
        description="Header naming the tenant, for class matches by tenant and for tenant "
        "shares of a class budget. Default: x-tenant-id.",
    )
    saturation: Saturation = Field(
        default_factory=Saturation, description="When the pool counts as saturated."
    )

    @property
    def ttft_bound(self) -> float:
        """The mean time to first token that saturates the pool: ``saturation.ttft``, else
        ``TTFT_SHARE`` of the most important class's objective."""
        if self.saturation.ttft is not None:
            return self.saturation.ttft
        return self.classes[0].objective.ttft * TTFT_SHARE

    def names(self) -> list[str]:
        """Class names, most important first."""
        return [service_class.name for service_class in self.classes]

    @property
    def queued(self) -> list[ServiceClass]:
        """The classes that wait in Envoy when restricted."""
        return [c for c in self.classes if c.when_saturated == "queue"]

    @property
    def default(self) -> str:
        """The class of requests that nothing else classifies."""
        return self.default_class or self.classes[0].name
