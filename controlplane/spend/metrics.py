"""Prometheus counters of this replica's spend."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from signals.spend import Ledger


class SpendCollector(Collector):
    """Prometheus counters of this replica's spend, read from its ledger at scrape time (no
    work per request). Sum over replicas: each exports what its own Envoys logged."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterable[Any]:
        labels = ["tenant", "model", "pool", "class", "route"]
        tokens = CounterMetricFamily(
            "kvpilot_tokens",
            "Tokens of responses through kvpilot's listeners, from OpenAI's usage object; kind "
            "prompt (uncached prompt), cached (prompt tokens from the prefix cache), completion.",
            labels=[*labels, "kind"],
        )
        requests = CounterMetricFamily(
            "kvpilot_usage_requests",
            "Responses that carried a usage object.",
            labels=labels,
        )
        cost = CounterMetricFamily(
            "kvpilot_spend",
            "What those tokens cost at the pool's per-token price, in the price's currency.",
            labels=[*labels, "currency"],
        )
        for key, spend in sorted(self.ledger.totals.items()):
            base = [key.tenant, key.model, key.pool, key.service_class, key.route]
            tokens.add_metric([*base, "prompt"], spend.prompt_tokens - spend.cached_tokens)
            tokens.add_metric([*base, "cached"], spend.cached_tokens)
            tokens.add_metric([*base, "completion"], spend.completion_tokens)
            requests.add_metric(base, spend.requests)
            if key.currency:
                cost.add_metric([*base, key.currency], float(spend.cost))
        yield tokens
        yield requests
        yield cost
