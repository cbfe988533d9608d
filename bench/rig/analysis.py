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
from typing import Any

KINDS = ("first turn", "moved", "evicted", "warm")


def own_prefill_seconds(uncached: int, sim: Mapping[str, Any]) -> float:
    """Simulated seconds a request's own prefill takes on an otherwise idle replica."""
    budget = int(sim["max_batched_tokens"])
    steps = max(1, -(-uncached // budget))
    return steps * float(sim["decode_base"]) + uncached * float(sim["prefill_per_token"])


def classify(per_request: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each successful request with its kind (see the module docstring), in session order."""
    by_session: dict[str, list[Mapping[str, Any]]] = {}
    for request in per_request:
        if request.get("status") == 200 and not request.get("error") and request.get("ttft"):
            by_session.setdefault(str(request["session"]), []).append(request)
    out: list[dict[str, Any]] = []
    for turns in by_session.values():
        turns.sort(key=lambda r: int(r["turn"]))
        previous: Mapping[str, Any] | None = None
        for request in turns:
            prompt = max(1, int(request["prompt_tokens"]))
            hit = int(request["cached_tokens"]) / prompt
            if int(request["turn"]) == 0 or previous is None:
                kind = "first turn"
            elif request["replica"] != previous["replica"]:
                kind = "moved"
            else:
                # The history is everything but the new question; missing half of the prompt
                # on the same replica means the history was evicted.
                kind = "evicted" if hit < 0.5 else "warm"
            out.append({**request, "kind": kind, "hit": hit})
            previous = request
    return out


def tail_breakdown(
    per_request: Sequence[Mapping[str, Any]], sim: Mapping[str, Any], quantile: float = 0.99
) -> dict[str, Any]:
    """Who the slowest ``1 - quantile`` of requests are (at least one), and how much of their
    TTFT was their own prefill versus waiting; with the same split for all requests."""
    rows = classify(per_request)
    if not rows:
        return {}
    count = max(1, math.ceil(len(rows) * (1 - quantile) - 1e-9))
    tail = sorted(rows, key=lambda r: float(r["ttft"]), reverse=True)[:count]
    cut = float(tail[-1]["ttft"])

    def split(group: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not group:
            return {"requests": 0}
        own = [
            own_prefill_seconds(int(r["prompt_tokens"]) - int(r["cached_tokens"]), sim)
            for r in group
        ]
        ttft = [float(r["ttft"]) for r in group]
        return {
            "requests": len(group),
            "kinds": dict(Counter(str(r["kind"]) for r in group)),
            "ttft_mean": statistics.fmean(ttft),
            "own_prefill_mean": statistics.fmean(own),
            "wait_share": 1 - sum(min(o, t) for o, t in zip(own, ttft, strict=True)) / sum(ttft),
            "hit_mean": statistics.fmean(float(r["hit"]) for r in group),
            "prompt_tokens_mean": statistics.fmean(int(r["prompt_tokens"]) for r in group),
            "replicas": dict(Counter(str(r["replica"]) for r in group)),
        }

    by_kind = {kind: split([r for r in rows if r["kind"] == kind]) for kind in KINDS}
    return {"cut": cut, "tail": split(tail), "all": split(rows), "by_kind": by_kind}


def describe(title: str, breakdown: Mapping[str, Any]) -> list[str]:
    """Markdown lines for one policy's breakdown."""
    if not breakdown:
        return []
    tail, everyone = breakdown["tail"], breakdown["all"]
    kinds = ", ".join(f"{tail['kinds'].get(k, 0)} {k}" for k in KINDS if tail["kinds"].get(k))
    lines = [
        f"- {title}: the slowest 1% ({tail['requests']} requests, TTFT "
        f"{breakdown['cut']:.3f}s and more) are {kinds}; their mean TTFT {tail['ttft_mean']:.3f}s, of which their own prefill "
        f"{tail['own_prefill_mean']:.3f}s ({1 - tail['wait_share']:.0%}) and waiting "
        f"{tail['wait_share']:.0%}; mean hit {tail['hit_mean']:.0%}, prompts "
        f"{tail['prompt_tokens_mean']:.0f} tokens. All requests: "
        + ", ".join(
            f"{k} {v['requests']} (TTFT {v['ttft_mean']:.3f}s, hit {v['hit_mean']:.0%})"
            for k, v in breakdown["by_kind"].items()
            if v["requests"]
        )
        + f"; waiting is {everyone['wait_share']:.0%} of all TTFT."
    ]
    return lines
