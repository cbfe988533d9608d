"""Cost-aware overflow: a route's paid pools, which take its traffic only while its own
replicas are saturated or miss the route's objective."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from policies.models.fields import Duration, Model, Name

Conversations = Literal["last", "with"]
GATE_AUTO_SHARE = 0.9
"""``maxInFlight: auto``: the share of the owned replicas' batch slots that the gates of all
the Envoys of the route's fleets let in together (the cost benchmark met its targets at 90%)."""
OverflowSignal = Literal["arrivals", "fill"]
UTILIZATION = 0.9
"""``Overflow.utilization`` when unset: the share that holds the cost benchmark's TTFT p99 at
batches of 32, where 0.97 (spill's share of a locality's capacity) left it 1.6x the static
split's; at batches of 8 the two are a trade of spend for the peak (docs/cost-overflow.md)."""
UTILIZATION_STORED_BEFORE = 0.97
"""What versions before 0.9 stored in every overflow's ``utilization`` (objects are stored
with their defaults filled in): accepted with ``signal: fill`` so that such a route still
loads, where any other value set for the loop is refused."""


class Overflow(Model):
    """Paid capacity for a route: external provider pools (paid per token) that take a share of
    the route's requests while the replicas of its first tier (capacity already paid for) are
    saturated or miss the objective, and none while those replicas have room.

    kvpilot reads the first tier's live telemetry (``Pool.spec.telemetry``): pressure is the
    largest of their mean batch fill over ``fill``, their mean time to first token over half
    of ``ttft`` and their mean queue over ``queue``. At a pressure of ``high`` or more, and not
    falling, the overflowed share rises at once by the excess (1.5 sends half again as much);
    at ``low`` or less one ``step`` comes back each ``recoverInterval``; between the two
    nothing moves. The share travels to Envoy in the route configuration (a runtime fraction
    of the route's entries): Envoy draws per request, and Python stays out of the path.
    """

    pools: list[Name] = Field(
        min_length=1,
        max_length=8,
        description="Paid pools (external providers: TLS or DNS-named endpoints) that may take "
        "the overflow, cheapest first: overflow goes to the first one not resting after a 429, "
        "and a request one of them refuses is retried on the next, then on the route's own "
        "replicas.",
    )
    ttft: Duration | None = Field(
        None,
        gt=0,
        description="The route's time-to-first-token objective: the replicas cannot meet it "
        "once their mean time to first token (as the engines report it) passes half of it. "
        "With signal: arrivals, the requests waiting on them beyond what can be served within "
        "half of it go to the paid pools too (drained over 5 s). "
        "Default: none (batch fill and queue only; with arrivals, no queue drained).",
    )
    fill: float = Field(
        0.9,
        gt=0,
        le=4,
        description="Mean batch fill of the replicas, (running + waiting) / batch size, at "
        "which they count as saturated; needs agents that know the batch size "
        "(kvpilot agent --max-running). Default: 0.9.",
    )
    queue: float = Field(
        2.0,
        gt=0,
        description="Mean requests waiting per replica at which they count as saturated. "
        "Default: 2.",
    )
    conversations: Conversations = Field(
        "last",
        description="Requests with the session-affinity header (a conversation whose KV cache "
        "the replicas hold, which a paid API does not): 'last' overflows them only once every "
        "other request of the route does; 'with' overflows them in the same share as the rest "
        "(a plain split). Default: last.",
    )
    min_share: int = Field(
        0,
        ge=0,
        le=100,
        description="Floor of the share of each kind of request (with and without a session) "
        "that goes to the paid pools, in percent, whatever the telemetry says. With maxShare "
        "equal to it, a static split. Default: 0.",
    )
    max_share: int = Field(
        100,
        ge=0,
        le=100,
        description="Cap of that share, in percent: holds even when the telemetry is wrong. "
        "Default: 100.",
    )
    step: int = Field(
        10,
        ge=1,
        le=100,
        description="Share given back at a time, and the unit the share moves in, in percent. "
        "Default: 10.",
    )
    high: float = Field(1.0, gt=0, description="Pressure at which the share rises. Default: 1.0.")
    low: float = Field(
        0.8,
        ge=0,
        description="Pressure at or below which one step comes back. Default: 0.8.",
    )
    raise_interval: Duration = Field(
        3.0,
        description="Least time between two rises of the share: about as long as a request "
        "holds its replica, so a rise shows in the telemetry before the next one (in the cost "
        "benchmark 1s overshot to two thirds of the peak's requests). Default: 3s.",
    )
    recover_interval: Duration = Field(
        5.0,
        description="Least time between a change and a step given back, so a pool that just "
        "got room does not take back more than it can hold (flapping). Default: 5s.",
    )

    signal: OverflowSignal = Field(
        "arrivals",
        description="What sets the paid share. fill: the loop on the owned replicas' "
        "pressure (batch fill, queue, TTFT) described above. arrivals: the route's arrival "
        "rate, as its Envoys report each request's start, against the owned replicas' "
        "capacity measured while their batches were full; the paid pools take what is above "
        "it, corrected by the batch fill (signals.overflowff). Its listeners then report "
        "every upstream attempt's start and end to kvpilot. Not with feedForward. "
        "Default: arrivals (in the cost benchmark it paid 0.64-0.88x the loop's spend, seed "
        "by seed, its peak TTFT p99 from level with the loop's to 1.46x slower by run).",
    )
    utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="With signal: arrivals, the share of the owned replicas' measured "
        "capacity they carry before the paid pools take the rest of the demand. Lower keeps "
        "a shorter queue on them at a peak and pays for more requests: the trade between "
        "paid spend and the peak's latency (measured in docs/cost-overflow.md). "
        "Unset: 0.9 (at batches of 32, 0.97 left the owned replicas' TTFT p99 1.6x the "
        "static split's; 0.9 level with it; 0.8 for routes whose latency matters more); "
        "stored unset, so a later default applies.",
    )
    prefill_weight: float | None = Field(
        None,
        ge=0.01,
        le=1,
        description="With signal: arrivals, what an uncached prompt token counts against an "
        "output token in the work demand and capacity are counted in: the time a prompt token "
        "takes to prefill over the time an output token takes at a full batch (0.086 for the "
        "benchmark's simulated engine at 8 sequences, 0.24 at 32). Unset: learned from the "
        "owned engines' own counters while they are busy (vLLM's steps counted; full batches "
        "only for an engine that does not export them), 0.1 until the fit can say it "
        "(signals.prefillfit). Set it for replicas that export no steps and are seldom full, "
        "from a run of them kept full.",
    )
    max_in_flight: Annotated[int, Field(ge=1, le=100_000)] | Literal["auto"] | None = Field(
        None,
        description="Requests each Envoy keeps in flight on the owned replicas, conversations "
        "included: about 90% of their batch slots (replicas x batch size) over the fleet's "
        "Envoys (in the cost benchmark at batches of 8, 90% met every target by the median; the "
        "full slots paid less and held less of the peak's tail; at 32, level with no gate). "
        "'auto': kvpilot sets it to 90% (gateShare) of the batch slots the agents report for the first "
        "tier's serving replicas over the Envoys connected in the policy's fleets, and follows "
        "both as they change (while none reports a batch size: 100000, an open gate). Behind the gate no replica takes more "
        "than the mean of what it lets in. A "
        "request without a session that finds them all taken goes to the paid pool at once, "
        "in the same request (Envoy's circuit breaker on a gate in front of the replicas, and "
        "a retry); a conversation waits on its replica. It takes the first seconds of a peak "
        "that the share (signal) follows only later. Every request then passes the gate, an "
        "internal listener: a second HTTP pass inside Envoy. Not with pools that serve "
        "several models by subsets. Default: none (no gate).",
    )
    gate_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="With maxInFlight: auto, the share of the reported batch slots the "
        "gates let in. Lower leaves room for the prompts a full batch still prefills and "
        "sends more to the paid pools; 1 crosses only what finds every slot taken (the "
        "regions benchmark's spot wave: the requests that stayed did not wait, "
        "docs/regions.md). Unset: 0.9 (the cost benchmark met its targets there); stored "
        "unset, so a later default applies.",
    )
    feed_forward: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Weight of a feed-forward share added each round to what the loop sends: "
        "the replicas' excess demand, 1 - fill / (their mean batch fill), of the requests "
        "still on them, times this weight; it follows the telemetry at once, with no "
        "interval and no hysteresis, and falls to nothing when the fill is at or below the "
        "bound. Plain requests first, as the loop. Default: 0 (off).",
    )

    @field_validator("pools")
    @classmethod
    def _unique(cls, pools: list[str]) -> list[str]:
        twice = sorted({name for name in pools if pools.count(name) > 1})
        if twice:
            raise ValueError(f"pool {twice[0]!r} is listed twice")
        return pools

    @model_validator(mode="after")
    def _bounds(self) -> Overflow:
        if self.min_share > self.max_share:
            raise ValueError("overflow minShare must not be above maxShare")
        if self.low >= self.high:
            raise ValueError("overflow low must be below high (the hysteresis band)")
        if self.signal == "arrivals" and self.feed_forward > 0:
            raise ValueError(
                "overflow feedForward is for signal: fill (set it); with signal: arrivals, "
                "the default, the arrival rate sets the share already"
            )
        if self.signal == "fill" and self.prefill_weight is not None:
            raise ValueError(
                "overflow prefillWeight is for signal: arrivals, which counts demand and "
                "capacity in work; the loop (signal: fill) reads the batch fill"
            )
        if self.gate_share is not None and self.max_in_flight != "auto":
            raise ValueError(
                "overflow gateShare is for maxInFlight: auto (the share of the reported batch "
                "slots); a number in maxInFlight is the limit itself"
            )
        if self.signal == "fill" and self.utilization not in (None, UTILIZATION_STORED_BEFORE):
            raise ValueError(
                "overflow utilization is for signal: arrivals; with signal: fill, fill sets "
                "the batch fill at which the replicas count as saturated"
            )
        return self

    def auto_share(self) -> float:
        """The share of the batch slots ``maxInFlight: auto`` lets in: ``gateShare``, or
        ``GATE_AUTO_SHARE`` when it is unset."""
        return GATE_AUTO_SHARE if self.gate_share is None else self.gate_share

    def owned_share(self) -> float:
        """The share of their measured capacity the owned replicas carry: ``utilization``,
        or ``UTILIZATION`` when it is unset."""
        return UTILIZATION if self.utilization is None else self.utilization
