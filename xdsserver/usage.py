"""Token usage from Envoy's access logs into a spend Ledger, off the request path.

Envoy's accounting filter (``xdsserver.translate.usage``) leaves each response's usage in
dynamic metadata, and the connection manager's access log sends it to kvpilot's access log
service in batches. Here one entry becomes one row of counters: the tenant from the route's
tenant header, the model that answered (the response's ``model``), the pool of the upstream
host that served the last attempt (a provider's from the host's ``kvpilot.pool`` metadata,
a replica's from its address), the service class and the route from the route entry's name,
the virtual model the client called (when a virtual model's Lua chose the model), and the
cost at the pool's price in force when the entry arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from signals.overflowdemand import route_of
from signals.spend import Ledger, Spend, SpendKey, TokenPrice
from xdsserver.translate.listeners import DIFFICULTY_METADATA
from xdsserver.translate.metadata import POOL_TAG
from xdsserver.translate.usage import USAGE_FILTER


class UsageContext(Protocol):
    """What an entry is resolved against: the current plan and the pools' prices."""

    def pool(self, cluster: str, address: str, port: int) -> str | None:
        """The pool of an upstream host (None: not a known pool's host)."""

    def price(self, pool: str) -> TokenPrice | None:
        """The pool's per-token price (None: not priced per token)."""

    def tenant_header(self, route: str) -> str:
        """The header that names the tenant on a route (``policy/route``)."""


def parse_route_name(name: str) -> tuple[str, str]:
    """``policy/route#0@class/affinity`` -> (``policy/route``, ``class``); entries without a
    class give an empty class."""
    route, _, rest = name.partition("#")
    _, at, service_class = rest.partition("@")
    return route, service_class.split("/", 1)[0] if at else ""


class UsageBook:
    """Folds usage entries into a Ledger; counts what it could not attribute."""

    def __init__(self, context: UsageContext, clock: Callable[[], float] = time.time) -> None:
        self.context = context
        self.clock = clock
        self.ledger = Ledger()
        self.entries = 0
        """Entries that carried usage."""
        self.without_usage = 0
        """Entries without usage: local replies (429, 404), errors, non-OpenAI answers."""
        self.listeners: list[Callable[[], None]] = []
        """Called after each batch of entries (budget checks)."""

    def observe(self, entry: Any) -> None:
        """Count one ``HTTPAccessLogEntry`` of a usage log."""
        common = entry.common_properties
        fields = common.metadata.filter_metadata.get(USAGE_FILTER)
        if fields is None or "prompt" not in fields.fields:
            self.without_usage += 1
            return
        values = fields.fields
        prompt = int(values["prompt"].number_value)
        cached = int(values["cached"].number_value) if "cached" in values else 0
        completion = int(values["completion"].number_value) if "completion" in values else 0
        model = values["model"].string_value if "model" in values else ""
        route, service_class = parse_route_name(common.route_name)
        # A provider's host names its pool in its metadata (its address is a DNS name, so
        # the address Envoy logs names no pool); a replica is found by its address.
        socket = common.upstream_remote_address.socket_address
        pool = (
            common.custom_tags.get(POOL_TAG, "")
            or (
                self.context.pool(common.upstream_cluster, socket.address, socket.port_value)
                if socket.address
                else self._behind_gate(common.upstream_cluster, values)
            )
            or ""
        )
        header = self.context.tenant_header(route)
        tenant = entry.request.request_headers.get(header, "") if header else ""
        price = self.context.price(pool) if pool else None
        # The virtual model's Lua leaves its key in the same stream's metadata.
        chosen = common.metadata.filter_metadata.get(DIFFICULTY_METADATA)
        virtual = chosen.fields.get("virtual") if chosen is not None else None
        key = SpendKey(
            tenant=tenant,
            model=model,
            pool=pool,
            service_class=service_class,
            route=route,
            currency=price.currency if price is not None else "",
            virtual_model=virtual.string_value if virtual is not None else "",
        )
        spend = Spend(
            requests=1,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
        )
        if price is not None:
            spend.cost = price.cost(prompt, cached, completion)
        self.entries += 1
        self.ledger.add(key, spend, self.clock())

    def _behind_gate(self, cluster: str, values: Any) -> str | None:
        """The pool of the replica that answered through a route's gate: the gate names it
        in ``GATE_UPSTREAM``, which the usage filter keeps in the metadata (the host Envoy
        logs is the gate's internal listener)."""
        address = values["upstream"].string_value if "upstream" in values else ""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            return None
        return self.context.pool(route_of(cluster), host, int(port))

    def batch_done(self) -> None:
        for listener in self.listeners:
            listener()
