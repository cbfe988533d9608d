"""Prometheus metrics of this replica's spend, and of what virtual models saved."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from signals import PolicyState
from signals.savings import virtual_savings
from signals.spend import Ledger, group


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
        # The virtual model is part of a key but not a label here: rows that differ only by
        # it are summed (kvpilot_virtual_model_spend_* carry it).
        grouped = group(
            self.ledger.totals, ("tenant", "model", "pool", "service_class", "route", "currency")
        )
        for (*base, currency), spend in sorted(grouped.items()):
            tokens.add_metric([*base, "prompt"], spend.prompt_tokens - spend.cached_tokens)
            tokens.add_metric([*base, "cached"], spend.cached_tokens)
            tokens.add_metric([*base, "completion"], spend.completion_tokens)
            requests.add_metric(base, spend.requests)
            if currency:
                cost.add_metric([*base, currency], float(spend.cost))
        yield tokens
        yield requests
        yield cost


class SavingsCollector(Collector):
    """Per virtual model, what its requests cost at the pools that served them, what the same
    tokens would have cost at the large model's price, and the difference, from this
    replica's ledger at scrape time. Gauges: the large model's price in force applies to all
    past tokens, so a price change moves them both ways. Sum over replicas."""

    def __init__(self, ledger: Ledger, state: Callable[[], PolicyState | None]) -> None:
        self.ledger = ledger
        self.state = state

    def collect(self) -> Iterable[Any]:
        labels = ["virtual_model", "currency"]
        spent = GaugeMetricFamily(
            "kvpilot_virtual_model_spend",
            "What a virtual model's requests cost at the per-token prices of the pools that "
            "served them (where a saving can be stated: docs/difficulty.md).",
            labels=labels,
        )
        large = GaugeMetricFamily(
            "kvpilot_virtual_model_spend_large",
            "What the same tokens would have cost at the large model's per-token price.",
            labels=labels,
        )
        saved = GaugeMetricFamily(
            "kvpilot_virtual_model_spend_saved",
            "kvpilot_virtual_model_spend_large less kvpilot_virtual_model_spend: what routing "
            "by difficulty saved against sending everything to the large model.",
            labels=labels,
        )
        state = self.state()
        if state is not None:
            for key, result in virtual_savings(state, self.ledger.totals).items():
                if result.saved is None or result.large_cost is None:
                    continue
                spent.add_metric([key, result.currency], float(result.usage.cost))
                large.add_metric([key, result.currency], float(result.large_cost))
                saved.add_metric([key, result.currency], float(result.saved))
        yield spent
        yield large
        yield saved
