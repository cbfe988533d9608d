"""Where the slow first tokens come from: a per-request breakdown of TTFT (pure, no I/O).

For every request the load generator knows the session, the turn, the replica that answered,
the prompt tokens and the cached ones. From those and the simulator's cost model this module
splits each time to first token into the request's own prefill work (its uncached tokens, in
chunks of the step's token budget) and everything else: waiting in the replica's queue and
sharing steps with other sequences' prefills. It then asks, for the slowest 1%, which kind of
request they are:

- ``first turn``: the first request of a session, and every request without a session (only
  a shared prefix, a system prompt or a document, can be cached);
- ``moved``: a later turn answered by another replica than the session's previous turn
  (bounded load spilled it, or the policy does not keep sessions together), so its history
  is cold there;
- ``evicted``: a later turn on the same replica that still missed most of its history (the
  replica's cache evicted it);
- ``warm``: a later turn that found its history, slow only because it waited.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.rig.jsonfields import known, without_none
from bench.rig.loadgen import RequestResult
from replicasim.simulator import SimConfig

KINDS = ("first turn", "moved", "evicted", "warm")


def own_prefill_seconds(uncached: int, sim: SimConfig) -> float:
    """Simulated seconds a request's own prefill takes on an otherwise idle replica."""
    budget = sim.max_batched_tokens
    steps = max(1, -(-uncached // budget))
    return steps * sim.decode_base + uncached * sim.prefill_per_token


@dataclass(frozen=True)
class Classified:
    """A successful request and its kind (see the module docstring)."""

    request: RequestResult
    kind: str
    hit: float
    """Its cached share of the prompt."""


def classify(per_request: Sequence[RequestResult]) -> list[Classified]:
    """Each successful request with its kind (see the module docstring), in session order."""
    by_session: dict[str, list[RequestResult]] = {}
    for request in per_request:
        if request.ok and request.ttft:
            by_session.setdefault(request.session, []).append(request)
    out: list[Classified] = []
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        previous: RequestResult | None = None
        for request in turns:
            hit = request.cached_tokens / max(1, request.prompt_tokens)
            if request.turn == 0 or previous is None:
                kind = "first turn"
            elif request.replica != previous.replica:
                kind = "moved"
            else:
                # The history is everything but the new question; missing half of the prompt
                # on the same replica means the history was evicted.
                kind = "evicted" if hit < 0.5 else "warm"
            out.append(Classified(request, kind, hit))
            previous = request
    return out


@dataclass(frozen=True)
class TailGroup:
    """Some requests' TTFT split into their own prefill and waiting (only ``requests`` when
    there are none)."""

    requests: int
    kinds: dict[str, int] | None = None
    ttft_mean: float | None = None
    own_prefill_mean: float | None = None
    wait_share: float | None = None
    """The share of their TTFT that was not their own prefill."""
    hit_mean: float | None = None
    prompt_tokens_mean: float | None = None
    replicas: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        return without_none(asdict(self), *(name for name in asdict(self) if name != "requests"))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TailGroup:
        return cls(**known(cls, data))


@dataclass(frozen=True)
class TailBreakdown:
    """Who the slowest requests were, and the same split for every request and every kind."""

    cut: float
    """The TTFT from which a request is in the tail."""
    tail: TailGroup
    everyone: TailGroup
    by_kind: dict[str, TailGroup] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "cut": self.cut,
            "tail": self.tail.to_json(),
            "all": self.everyone.to_json(),
            "by_kind": {kind: group.to_json() for kind, group in self.by_kind.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TailBreakdown | None:
        """The breakdown as `to_json` wrote it; None for the empty one (no request)."""
        if not data:
            return None
        return cls(
            float(data["cut"]),
            TailGroup.from_json(data["tail"]),
            TailGroup.from_json(data["all"]),
            {kind: TailGroup.from_json(group) for kind, group in data["by_kind"].items()},
        )


def tail_breakdown(
    per_request: Sequence[RequestResult], sim: SimConfig, quantile: float = 0.99
) -> TailBreakdown | None:
    """Who the slowest ``1 - quantile`` of requests are (at least one), and how much of their
    TTFT was their own prefill versus waiting; with the same split for all requests. None
    when no request succeeded."""
    rows = classify(per_request)
    if not rows:
        return None

    def ttft(row: Classified) -> float:
        return row.request.ttft or 0.0

    count = max(1, math.ceil(len(rows) * (1 - quantile) - 1e-9))
    tail = sorted(rows, key=ttft, reverse=True)[:count]
    cut = ttft(tail[-1])

    def split(group: Sequence[Classified]) -> TailGroup:
        if not group:
            return TailGroup(requests=0)
        own = [
            own_prefill_seconds(r.request.prompt_tokens - r.request.cached_tokens, sim)
            for r in group
        ]
        ttfts = [ttft(r) for r in group]
        return TailGroup(
            requests=len(group),
            kinds=dict(Counter(r.kind for r in group)),
            ttft_mean=statistics.fmean(ttfts),
            own_prefill_mean=statistics.fmean(own),
            wait_share=1 - sum(min(o, t) for o, t in zip(own, ttfts, strict=True)) / sum(ttfts),
            hit_mean=statistics.fmean(r.hit for r in group),
            prompt_tokens_mean=statistics.fmean(r.request.prompt_tokens for r in group),
            replicas=dict(Counter(r.request.replica for r in group)),
        )

    by_kind = {kind: split([r for r in rows if r.kind == kind]) for kind in KINDS}
    return TailBreakdown(cut, split(tail), split(rows), by_kind)


def describe(title: str, breakdown: TailBreakdown | None) -> list[str]:
    """Markdown lines for one policy's breakdown."""
    if breakdown is None:
        return []
    tail, everyone = breakdown.tail, breakdown.everyone
    found = tail.kinds or {}
    kinds = ", ".join(f"{found.get(k, 0)} {k}" for k in KINDS if found.get(k))
    lines = [
        f"- {title}: the slowest 1% ({tail.requests} requests, TTFT "
        f"{breakdown.cut:.3f}s and more) are {kinds}; their mean TTFT {tail.ttft_mean:.3f}s, of which their own prefill "
        f"{tail.own_prefill_mean:.3f}s ({1 - (tail.wait_share or 0.0):.0%}) and waiting "
        f"{tail.wait_share:.0%}; mean hit {tail.hit_mean:.0%}, prompts "
        f"{tail.prompt_tokens_mean:.0f} tokens. All requests: "
        + ", ".join(
            f"{k} {v.requests} (TTFT {v.ttft_mean:.3f}s, hit {v.hit_mean:.0%})"
            for k, v in breakdown.by_kind.items()
            if v.requests
        )
        + f"; waiting is {everyone.wait_share:.0%} of all TTFT."
    ]
    return lines
