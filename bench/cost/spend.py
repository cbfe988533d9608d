"""kvpilot's own spend over one policy's replay, beside the spend the load generator computes
from the responses' ``usage``.

A finance owner reads kvpilot's counters (``GET /v1/spend``, ``kvpilot_spend_total``), not
the benchmark's arithmetic, so the benchmark reads them too: the fleet's spend per pool
before and after each policy's replay, the difference being what that policy cost by
kvpilot's account. The load generator's account is the same responses' usage at the same
prices, summed exactly (``Decimal``, as kvpilot sums). Token counts are integers and money
is exact on both sides, so the two must be equal; any difference is reported.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import httpx

from bench.cost.config import PAID_POOL, PAID_PREFIX, Prices
from bench.rig.loadgen import RequestResult
from bench.rig.stack import POOL

MILLION = Decimal(1_000_000)


@dataclass(slots=True)
class PoolSpend:
    """One pool's responses with usage, their tokens and what they cost."""

    requests: int = 0
    prompt: int = 0
    """Prompt tokens, cached ones included (OpenAI's ``prompt_tokens``)."""
    cached: int = 0
    completion: int = 0
    cost: Decimal = field(default_factory=Decimal)

    def minus(self, other: PoolSpend) -> PoolSpend:
        return PoolSpend(
            self.requests - other.requests,
            self.prompt - other.prompt,
            self.cached - other.cached,
            self.completion - other.completion,
            self.cost - other.cost,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt,
            "cached_tokens": self.cached,
            "completion_tokens": self.completion,
            "cost": str(self.cost),
        }


def from_view(body: Mapping[str, Any]) -> dict[str, PoolSpend]:
    """Per pool, from ``GET /v1/spend?by=pool`` (one currency in this benchmark)."""
    out: dict[str, PoolSpend] = {}
    for row in body.get("rows", []):
        spend = out.setdefault(str(row["pool"]), PoolSpend())
        spend.requests += int(row["requests"])
        spend.prompt += int(row["promptTokens"])
        spend.cached += int(row["cachedTokens"])
        spend.completion += int(row["completionTokens"])
        spend.cost += Decimal(row["cost"])
    return out


def read(api_url: str, token: str) -> dict[str, PoolSpend]:
    """The fleet's spend per pool since kvpilot started counting."""
    response = httpx.get(
        f"{api_url}/v1/spend",
        params={"window": "total", "by": "pool"},
        headers={"authorization": f"Bearer {token}"},
        timeout=10,
    )
    response.raise_for_status()
    return from_view(response.json())


def hourly(api_url: str, token: str, pool: str) -> Decimal | None:
    """What kvpilot says an owned pool costs an hour (its replicas now at their hourly
    price), from the ``pools`` part of ``GET /v1/spend``; None if it reports none."""
    response = httpx.get(
        f"{api_url}/v1/spend",
        params={"window": "hour", "by": "pool"},
        headers={"authorization": f"Bearer {token}"},
        timeout=10,
    )
    response.raise_for_status()
    for cost in response.json().get("pools", []):
        if cost.get("pool") == pool and cost.get("hourly") is not None:
            return Decimal(cost["hourly"])
    return None


def settled(
    api_url: str,
    token: str,
    *,
    expect: int | None = None,
    since: Mapping[str, PoolSpend] | None = None,
    quiet: float = 1.0,
    timeout: float = 30.0,
) -> dict[str, PoolSpend]:
    """kvpilot's spend once it stops moving: unchanged for `quiet` seconds (Envoy flushes
    its usage log every 0.1 s), and, with `expect`, once the responses counted since `since`
    reach that many. Returns what it read last when `timeout` passes first."""
    deadline = time.monotonic() + timeout
    last = read(api_url, token)
    stable_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = read(api_url, token)
        if now != last:
            last, stable_since = now, time.monotonic()
            continue
        counted = sum(s.requests for s in between(now, since or {}).values())
        if time.monotonic() - stable_since >= quiet and (expect is None or counted >= expect):
            break
    return last


def between(
    after: Mapping[str, PoolSpend], before: Mapping[str, PoolSpend]
) -> dict[str, PoolSpend]:
    """What was counted between two readings, per pool (pools with nothing counted left out)."""
    out = {}
    for pool, spend in after.items():
        delta = spend.minus(before.get(pool, PoolSpend()))
        if delta != PoolSpend():
            out[pool] = delta
    return out


def paid_cost(prices: Prices, prompt: int, cached: int, completion: int) -> Decimal:
    """A paid response's exact cost at the benchmark's prices, in their shortest decimal
    form (the strings the paid Pool's ``price`` is written with)."""
    cached = min(cached, prompt)
    return (
        (prompt - cached) * Decimal(str(prices.paid_input_per_mtok))
        + cached * Decimal(str(prices.paid_cached_input_per_mtok))
        + completion * Decimal(str(prices.paid_output_per_mtok))
    ) / MILLION


def from_responses(results: Iterable[RequestResult], prices: Prices) -> dict[str, PoolSpend]:
    """The load generator's account: every response that carried usage, per pool (the paid
    API's replica id tells its responses apart), the paid ones at the paid prices."""
    out: dict[str, PoolSpend] = {}
    for result in results:
        if not (result.prompt_tokens or result.completion_tokens):
            continue  # no usage seen (an error before the last event)
        paid = result.replica.startswith(PAID_PREFIX)
        spend = out.setdefault(PAID_POOL if paid else POOL, PoolSpend())
        spend.requests += 1
        spend.prompt += result.prompt_tokens
        spend.cached += result.cached_tokens
        spend.completion += result.completion_tokens
        if paid:
            spend.cost += paid_cost(
                prices, result.prompt_tokens, result.cached_tokens, result.completion_tokens
            )
    return out


def differences(kvpilot: Mapping[str, PoolSpend], responses: Mapping[str, PoolSpend]) -> list[str]:
    """Where kvpilot's account and the responses' differ, one sentence each; empty when
    they agree to the token and to the last digit of money."""
    out = []
    for pool in sorted(set(kvpilot) | set(responses)):
        ours, theirs = kvpilot.get(pool, PoolSpend()), responses.get(pool, PoolSpend())
        for name in ("requests", "prompt", "cached", "completion", "cost"):
            a, b = getattr(ours, name), getattr(theirs, name)
            if a != b:
                out.append(f"pool {pool}: {name} {a} by kvpilot's spend, {b} from the responses")
    return out


__all__ = [
    "PoolSpend",
    "between",
    "differences",
    "from_responses",
    "from_view",
    "hourly",
    "paid_cost",
    "read",
    "settled",
]
