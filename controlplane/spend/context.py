"""Usage entries resolved against the reconciler's current plan and state: which pool an
upstream address belongs to, the pool's per-token price, the route's tenant header."""

from __future__ import annotations

from collections.abc import Callable

from compiler import RoutingPlan
from controlplane.rollouts.signals import PlanResolver
from signals import PolicyState
from signals.spend import TokenPrice, token_price


class PlanContext:
    """Resolves usage entries against the reconciler's current plan and state."""

    def __init__(
        self,
        plan: Callable[[], RoutingPlan | None],
        state: Callable[[], PolicyState | None],
    ) -> None:
        self._plan = plan
        self._state = state
        self._pools = PlanResolver(plan)
        self._seen: RoutingPlan | None = None
        self._headers: dict[str, str] = {}

    def pool(self, cluster: str, address: str, port: int) -> str | None:
        return self._pools(cluster, address, port)

    def price(self, pool: str) -> TokenPrice | None:
        state = self._state()
        spec = state.pools.get(pool) if state is not None else None
        return token_price(spec.spec.price if spec is not None else None)

    def tenant_header(self, route: str) -> str:
        plan = self._plan()
        if plan is not self._seen:
            self._headers = {
                plan_route.name: plan_route.tenant_header
                for fleet in (plan.fleets if plan is not None else ())
                for listener in fleet.listeners
                for vhost in listener.virtual_hosts
                for plan_route in vhost.routes
            }
            self._seen = plan
        return self._headers.get(route, "")
