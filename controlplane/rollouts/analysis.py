"""The numbers a rollout's query rules ask Prometheus for: each rule's PromQL with the step's
canary and stable pools, route and interval filled in, sent to the HTTP query API. A query
that fails or returns nothing is None, which the rule's verdict treats as no data."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx

from controlplane.rollouts.state import canary_pools
from policies import Rollout

log = logging.getLogger(__name__)


class PrometheusQueries:
    """The query rules' values, over one HTTP client opened on first use."""

    def __init__(self) -> None:
        self._http: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def values(
        self, rollout: Rollout, state: Mapping[str, Any], now: float
    ) -> dict[int, float | None]:
        """Values of the query rules from Prometheus (None where it returned nothing)."""
        source = rollout.spec.analysis.prometheus
        out: dict[int, float | None] = {}
        if source is None:
            return out
        if self._http is None:
            self._http = httpx.AsyncClient()
        start = state.get("startWeights") or {}
        canaries = canary_pools(rollout, start)
        stables = [p for p in rollout.spec.pools() if p not in canaries]
        held = max(1, int(now - float(state.get("stepStartedAt", now))))
        for index, rule in enumerate(rollout.spec.analysis.rules):
            if rule.query is None:
                continue
            query = (
                rule.query.replace("{canary}", "|".join(canaries))
                .replace("{stable}", "|".join(stables))
                .replace("{route}", rollout.spec.target.route)
                .replace("{interval}", f"{held}s")
            )
            out[index] = await self._query(source.url, query, source.timeout)
        return out

    async def _query(self, url: str, query: str, seconds: float) -> float | None:
        assert self._http is not None
        try:
            response = await self._http.get(
                url.rstrip("/") + "/api/v1/query", params={"query": query}, timeout=seconds
            )
            data = response.json().get("data", {})
        except (httpx.HTTPError, ValueError, AttributeError) as error:
            log.warning("prometheus query %r failed: %s", query, error)
            return None
        result = data.get("result")
        try:
            if data.get("resultType") == "scalar":
                return float(result[1])
            if result:
                return float(result[0]["value"][1])
        except (TypeError, ValueError, KeyError, IndexError):
            return None
        return None
