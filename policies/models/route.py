"""One route of a RoutingPolicy: which requests it matches, its failover tiers of weighted
pools, session affinity, retries, timeouts and rate limit."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from policies.models.fields import Duration, HeaderName, Model, Name
from policies.models.overflow import Overflow


class HeaderMatch(Model):
    """Match a request header exactly."""

    name: HeaderName = Field(description="Header name, lowercase.")
    value: str = Field(description="Exact value.")


class RouteMatch(Model):
    """Which requests a route takes. All given conditions must hold."""

    models: list[str] = Field(
        default_factory=list,
        description="OpenAI model names, read from the JSON body's 'model' field or the "
        "model override header. Default: any model.",
    )
    pool_models: bool = Field(
        False,
        description="Match the models the route's pools serve instead of a fixed list: a "
        "pool's own 'models' where it lists them, else the models and LoRA adapters its "
        "replicas report (read by the agent from each replica's model list), so the route "
        "follows what is loaded. Excludes 'models'. Default: false.",
    )
    path_prefix: str = Field("/", description="Request path prefix. Default: '/'.")
    headers: list[HeaderMatch] = Field(
        default_factory=list, description="Exact header matches. Default: none."
    )

    @model_validator(mode="after")
    def _one_model_source(self) -> RouteMatch:
        if self.pool_models and self.models:
            raise ValueError("give either models or poolModels: true, not both")
        return self

    @field_validator("path_prefix")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("pathPrefix must start with '/'")
        return value


class PoolTarget(Model):
    """A pool within a tier and its share of the tier's traffic."""

    pool: Name = Field(description="Name of a Pool.")
    weight: int = Field(
        100,
        ge=0,
        le=10_000,
        description="Share of this tier's traffic, relative to the tier's other pools. "
        "0 drains the pool. Default: 100.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"pool": value} if isinstance(value, str) else value


class Tier(Model):
    """One failover tier: Envoy uses tier k+1 only when tier k lacks healthy capacity."""

    pools: list[PoolTarget] = Field(min_length=1, description="Pools in this tier.")
    fleet_weights: dict[Name, dict[Name, Annotated[int, Field(ge=0, le=10_000)]]] = Field(
        default_factory=dict,
        description="Pool weights this tier has in the named fleets instead of the pools' "
        "'weight' (fleet -> pool -> weight; a pool left out gets 0). A Rollout that takes "
        "fleets in order sets this while a step has reached only its canary fleets. "
        "Default: none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, value: Any) -> Any:
        return {"pools": value} if isinstance(value, list | str) else value

    @field_validator("pools", mode="before")
    @classmethod
    def _one_pool(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Tier:
        names = [target.pool for target in self.pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"pool {duplicates[0]!r} appears twice in one tier")
        if sum(target.weight for target in self.pools) == 0:
            raise ValueError("at least one pool in a tier needs a weight above 0")
        for fleet, weights in self.fleet_weights.items():
            unknown = sorted(set(weights) - set(names))
            if unknown:
                raise ValueError(
                    f"fleetWeights.{fleet} names pool {unknown[0]!r}, which is not in the tier"
                )
            if sum(weights.values()) == 0:
                raise ValueError(f"fleetWeights.{fleet} needs a pool with a weight above 0")
        return self

    def weights_in(self, fleet: str) -> Tier:
        """This tier as the Envoys of ``fleet`` get it (its ``fleetWeights`` applied)."""
        weights = self.fleet_weights.get(fleet)
        if weights is None:
            return self if not self.fleet_weights else self.model_copy(update={"fleet_weights": {}})
        pools = [
            target.model_copy(update={"weight": weights.get(target.pool, 0)})
            for target in self.pools
        ]
        return self.model_copy(update={"pools": pools, "fleet_weights": {}})


HashAlgorithm = Literal["ring_hash", "maglev"]

TELEMETRY_HASH_BALANCE_FACTOR = 125
"""Bounded load of a ``balancing: telemetry`` route that does not set its own: spill, not
evict. A hot replica's excess turns go to another replica before a queue builds there, and
every session keeps its place; telemetry keeps the ring itself for capacity. In the scenario
benchmark it cut TTFT p99 against 150 in most scenarios, for a point or two of prefix-cache
hit rate and more turns answered away from their replica (README, Benchmarks)."""

TELEMETRY_SATURATED_HASH_BALANCE_FACTOR = 100
"""Bounded load of a ``balancing: telemetry`` route while its replicas are saturated
(``signals.saturation``), unless the route sets its own: no host above the mean. With full
batches a queue at one replica while another has a free slot is what costs, and in the
scenario benchmark's overload 100 cut TTFT p99 to under half of 125's."""


BOUNDED_LOAD_LADDER: tuple[int, ...] = (100, 125, 150, 200, 300, 450)
"""The bounded loads a ``capacityBound`` route may take (percent of the mean in flight), each
its own consistent-hash twin of one ring. About 1.25-1.5x apart: the factor that lets the
busiest replica fill the usable part of its batch and no more, ``100 * (batch - sqrt(batch))
/ mean in flight`` (``signals.saturation.usable_batch``), is 100 at nearly full batches,
100-150 at the fill of small batches, 200-300 at the calm fill of large ones and 450-600 in
the scenario benchmark's calm documents mix at batches of 32 (at batch sizes 8, 32 and 128).
Above them a ``capacityBound`` route has one more rung, ``UNBOUNDED_RUNG``: no bound at all.
Its seven twins cost Envoy little, about 0.3 MiB each per route at 8 replicas
(docs/bounded-load.md)."""

UNBOUNDED_RUNG = 1_000_000
"""The top rung of a ``capacityBound`` route's ladder: no bounded load (its twin has no
``hash_balance_factor``: the plain consistent hash of the same ring). A number above every
bound so the ladder stays ascending; it is never sent to Envoy as a factor. The route takes it
while the whole pool's requests in flight would fit one replica's usable batch: at a factor of
at least 100 x the replicas with fresh records (``signals.saturation.unbounded_at``), where a
host may hold everything in flight and a bound can spill only what a batch would have taken
at once."""


class SessionAffinity(Model):
    """Send a conversation's turns to the replica that holds its KV cache.

    Envoy hashes the session header onto a ring (or Maglev table) of the route's endpoints.
    Bounded load keeps any host under ``hashBalanceFactor``% of the average in-flight load, so a
    hot session spills over instead of creating a hotspot.
    """

    header: HeaderName = Field(
        "x-session-id", description="Header carrying the session ID. Default: x-session-id."
    )
    algorithm: HashAlgorithm = Field(
        "ring_hash", description="Consistent hash: ring_hash or maglev. Default: ring_hash."
    )
    hash_balance_factor: int = Field(
        150,
        ge=0,
        description="Bounded load, in percent of the average host load (100 = perfectly even, "
        "150 = no host above 1.5x average). 0 turns bounded load off. Default: 150; 125 on a "
        "route with balancing: telemetry.",
    )
    saturated_hash_balance_factor: int = Field(
        0,
        ge=0,
        description="Bounded load while the route's replicas are saturated, in percent like "
        "hashBalanceFactor: tighter, so no replica queues while another has a free slot. "
        "Saturated is read from live telemetry: the replicas' batches on average as full as "
        "hashBalanceFactor lets the busiest one be full (80% at 125), until they are back "
        "at three quarters of that, no sooner than 5 s after. Both bounds share one "
        "ring, so a session keeps its replica when the bound changes. Needs balancing: "
        "telemetry. 0 keeps hashBalanceFactor always. Default: 100 on a route with balancing: "
        "telemetry, else 0.",
    )
    capacity_bound: bool = Field(
        False,
        description="Bounded load follows the replicas' batch capacity: session requests take "
        "the largest of the bounds 100, 125, 150, 200, 300 and 450 (each a twin of one ring) at "
        "which the busiest replica still fits the usable part of its batch (the batch size "
        "less its square root, so a burst that arrives before the next scrape still finds a "
        "free slot): 100 x (batch - sqrt(batch)) / mean requests in flight, read from live "
        "telemetry (vLLM's max_num_seqs or kvpilot agent --max-running). No bound at all (a "
        "seventh twin, the plain consistent hash) while that is at least 100 x the replicas "
        "reporting, when all requests in flight would fit one replica's usable batch. "
        "saturatedHashBalanceFactor is the tightest it goes; without a known batch size it is "
        "hashBalanceFactor; the first record that knows it takes the loosest bound that fits "
        "(no bound only after 15 s). Tightens at once when that factor falls more than a "
        "tenth below the bound; loosens no sooner than 15 s after, and only as the peak of "
        "the requests in flight fades (by e in 30 s), so a lull does not leave a loose bound "
        "to the burst that ends it. Needs balancing: telemetry. "
        "false keeps two fixed bounds (hashBalanceFactor, and saturatedHashBalanceFactor while "
        "the batches are nearly full). At batches of 16 or less (the replicas' mean) the "
        "ladder does not pay: the square root of the batch, the noise of one scrape, is a "
        "quarter of it or more, so the route takes those two fixed bounds and their twins "
        "(the status says which and why). Default: true on a route with balancing: telemetry "
        "and bounded load, else false (docs/bounded-load.md).",
    )
    prefix_hash_chars: int = Field(
        0,
        ge=0,
        le=65536,
        description="When a request has no session header, hash the first N characters of its "
        "prompt instead, so requests sharing a long prefix meet the same cache. 0 turns it off. "
        "Default: 0.",
    )
    hot_prefix_share: int = Field(
        0,
        ge=0,
        le=100,
        description="With prefixHashChars: a prompt prefix that takes more than this percent of "
        "the recent prefix-hashed requests (a popular document) is spread over as many "
        "replicas as it has such shares, each of which then caches it, instead of holding one "
        "replica at its bounded load. Counted per Envoy worker over about the last 200 "
        "requests. 0 turns it off. Default: 0.",
    )

    @field_validator("hash_balance_factor", "saturated_hash_balance_factor")
    @classmethod
    def _factor(cls, value: int, info: ValidationInfo) -> int:
        if 0 < value < 100:
            name = to_camel(info.field_name or "")
            raise ValueError(f"{name} must be 0 (off) or at least 100 (percent)")
        return value

    def ladder(self) -> tuple[int, ...]:
        """The bounds of a ``capacityBound`` route, ascending: ``BOUNDED_LOAD_LADDER`` from
        ``saturatedHashBalanceFactor`` (or the ladder's bottom when it is 0) up, plus
        ``hashBalanceFactor`` (the bound without a known batch size), and last
        ``UNBOUNDED_RUNG`` (no bound). Empty on other routes."""
        if not self.capacity_bound or not self.hash_balance_factor:
            return ()
        bottom = self.saturated_hash_balance_factor or BOUNDED_LOAD_LADDER[0]
        rungs = {r for r in BOUNDED_LOAD_LADDER if r >= bottom}
        return (*sorted(rungs | {bottom, self.hash_balance_factor}), UNBOUNDED_RUNG)

    @model_validator(mode="after")
    def _hot_prefixes(self) -> SessionAffinity:
        if self.hot_prefix_share and not self.prefix_hash_chars:
            raise ValueError(
                "hotPrefixShare spreads prompt prefixes and needs prefixHashChars above 0"
            )
        return self


Balancing = Literal["round_robin", "least_request", "random", "telemetry", "orca"]
RetryOn = Literal["5xx", "reset", "connect-failure", "429", "gateway-error", "refused-stream"]
DEFAULT_RETRY_ON: tuple[RetryOn, ...] = ("5xx", "reset", "connect-failure", "429")


class Retries(Model):
    """Retries to other hosts, then to other tiers."""

    attempts: int = Field(2, ge=0, le=10, description="Retries after the first try. Default: 2.")
    retry_on: list[RetryOn] = Field(
        default_factory=lambda: list(DEFAULT_RETRY_ON),
        description="Conditions that trigger a retry. Default: 5xx, reset, connect-failure, 429.",
    )
    per_try_timeout: Duration = Field(
        0.0, description="Time limit of each try; 0 = the route timeout. Default: 0."
    )
    backoff_base: Duration = Field(0.025, description="Base retry back-off. Default: 25ms.")


class Timeouts(Model):
    """Time limits that suit long and streaming (SSE) generations."""

    request: Duration = Field(
        600.0,
        description="Whole-request limit including the full streamed response; 0 = none. "
        "Default: 600s.",
    )
    idle: Duration = Field(
        120.0,
        description="Limit on silence within a stream (no bytes either way); 0 = none. "
        "Default: 120s.",
    )


RateUnit = Literal["second", "minute", "hour"]


class RateLimit(Model):
    """Token-bucket limit enforced by each Envoy (per worker-shared bucket)."""

    requests: int = Field(ge=1, description="Requests allowed per unit.")
    unit: RateUnit = Field("second", description="Time unit. Default: second.")
    burst: int | None = Field(None, ge=1, description="Bucket size. Default: equal to requests.")
    tenant_header: HeaderName | None = Field(
        None,
        description="Header naming the tenant; each distinct value gets its own bucket of the "
        "same size. Default: one bucket for the route.",
    )


AdapterFallback = Literal["base", "notFound"]


class AdapterRouting(Model):
    """Where a request for a LoRA adapter goes, from what the replicas' agents report loaded.

    vLLM serves many adapters on one base model and loads them at run time; a request for an
    adapter that a replica has not loaded waits while it loads (and may evict another one).
    """

    affinity: bool = Field(
        True,
        description="Send a request for a model or adapter to the replicas that report it "
        "loaded (Envoy subset load balancing on the endpoints' reported models; session "
        "affinity and bounded load then hash within those replicas). Replicas that report "
        "nothing take no such request while another reports it. Not with balancing: orca. "
        "Default: true.",
    )
    fallback: AdapterFallback = Field(
        "base",
        description="A request for a model that no replica reports loaded: 'base' sends it to "
        "the route's replicas, which load it on demand (or answer 404 themselves when they "
        "cannot); 'notFound' answers OpenAI's 404 (code model_not_found) from Envoy. On a "
        "poolModels route, 'base' makes the route take requests for any model, after every "
        "other route of the policy. Default: base.",
    )


class Route(Model):
    """A set of requests and where they go."""

    name: Name = Field(description="Route name, unique within the policy.")
    match: RouteMatch = Field(default_factory=RouteMatch, description="Which requests.")
    tiers: list[Tier] = Field(
        min_length=1,
        max_length=8,
        description="Ordered failover tiers; the first is preferred.",
    )
    balancing: Balancing = Field(
        "least_request",
        description="How Envoy picks a host when no session affinity applies: round_robin, "
        "least_request (the host with the fewest requests in flight of all, Envoy's full "
        "scan, not the fewer of two drawn at random), random, telemetry (weights from live "
        "load) or orca (Envoy weighs hosts by the load they report per response). "
        "Default: least_request.",
    )
    session_affinity: SessionAffinity | None = Field(
        None, description="Consistent hashing on a session header. Default: off."
    )
    retries: Retries = Field(default_factory=Retries, description="Retry policy.")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="Time limits.")
    rate_limit: RateLimit | None = Field(None, description="Rate limit. Default: none.")
    service_class: Name | None = Field(
        None,
        description="Class of this route's requests that no class's match claims (see "
        "serviceClasses). Default: the policy's defaultClass.",
    )
    adapters: AdapterRouting = Field(
        default_factory=AdapterRouting,
        description="Routing by the models and LoRA adapters replicas report loaded.",
    )
    overflow: Overflow | None = Field(
        None,
        description="Paid pools that take a share of the route's requests while its first "
        "tier's replicas are saturated or miss the objective, and none otherwise. Needs "
        "telemetry on those replicas. Default: none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _telemetry_spills_sooner(cls, data: Any) -> Any:
        """A telemetry route's session affinity without its own factors gets
        `TELEMETRY_HASH_BALANCE_FACTOR`, `TELEMETRY_SATURATED_HASH_BALANCE_FACTOR` and
        ``capacityBound`` (written out, so a stored route shows them)."""
        if not isinstance(data, dict) or data.get("balancing") != "telemetry":
            return data
        key = "sessionAffinity" if "sessionAffinity" in data else "session_affinity"
        affinity = data.get(key)
        if not isinstance(affinity, dict):
            return data
        defaults = {
            ("hashBalanceFactor", "hash_balance_factor"): TELEMETRY_HASH_BALANCE_FACTOR,
            (
                "saturatedHashBalanceFactor",
                "saturated_hash_balance_factor",
            ): TELEMETRY_SATURATED_HASH_BALANCE_FACTOR,
        }
        missing: dict[str, Any] = {
            names[0]: value for names, value in defaults.items() if not set(names) & set(affinity)
        }
        if not {"capacityBound", "capacity_bound"} & set(affinity):
            missing["capacityBound"] = True
        if affinity.get("hashBalanceFactor", affinity.get("hash_balance_factor")) == 0:
            # Bounded load turned off stays off, saturated or not.
            missing.pop("saturatedHashBalanceFactor", None)
            missing.pop("capacityBound", None)
        return {**data, key: {**affinity, **missing}} if missing else data

    @model_validator(mode="after")
    def _check(self) -> Route:
        seen: set[str] = set()
        for tier in self.tiers:
            for target in tier.pools:
                if target.pool in seen:
                    raise ValueError(f"pool {target.pool!r} appears in more than one tier")
                seen.add(target.pool)
        if self.overflow is not None:
            both = sorted(seen & set(self.overflow.pools))
            if both:
                raise ValueError(
                    f"pool {both[0]!r} is both in a tier and in overflow.pools; a paid pool "
                    "takes overflow or failover, not both"
                )
        if self.session_affinity is not None and self.balancing == "orca":
            raise ValueError(
                "sessionAffinity and balancing 'orca' exclude each other: a cluster has one "
                "load-balancing policy"
            )
        if (
            self.session_affinity is not None
            and self.session_affinity.saturated_hash_balance_factor
            and self.balancing != "telemetry"
        ):
            raise ValueError(
                "sessionAffinity.saturatedHashBalanceFactor needs balancing: telemetry "
                "(saturation is read from the replicas' live telemetry)"
            )
        affinity = self.session_affinity
        if affinity is not None and affinity.capacity_bound:
            if self.balancing != "telemetry":
                raise ValueError(
                    "sessionAffinity.capacityBound needs balancing: telemetry (the batch "
                    "size and the requests in flight are read from live telemetry)"
                )
            if not affinity.hash_balance_factor:
                raise ValueError(
                    "sessionAffinity.capacityBound needs bounded load: set hashBalanceFactor "
                    "above 0 or capacityBound: false"
                )
        return self
