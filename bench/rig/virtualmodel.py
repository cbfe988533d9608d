"""A virtual model's stack for the difficulty benchmark's probes through a real Envoy
(`bench.difficulty.luaprice`, `bench.difficulty.sharerun`): the objects of a policy with a
small and a large target model on the stub upstream (`bench.rig.probe`) and a virtual model
over both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def virtual_model_objects(
    listener: int,
    backend: int,
    *,
    small: str,
    large: str,
    virtual: Mapping[str, Any],
    pool_spec: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """A pool per target model (named for it, both on `backend`, health checks off), and a
    policy on `listener` with a route per model (``small`` and ``large``, matched by model
    name) and the virtual model `virtual` (its ``name``, ``share``, ... ; its targets are
    these two); `pool_spec` adds to each pool's spec."""

    def pool(name: str) -> dict[str, Any]:
        return {
            "apiVersion": "kvpilot.io/v1",
            "kind": "Pool",
            "metadata": {"name": name},
            "spec": {
                "models": [name],
                "endpoints": [{"address": "127.0.0.1", "port": backend}],
                "healthCheck": {"enabled": False},
                **(pool_spec or {}),
            },
        }

    policy = {
        "apiVersion": "kvpilot.io/v1",
        "kind": "RoutingPolicy",
        "metadata": {"name": "main"},
        "spec": {
            "listener": {"address": "127.0.0.1", "port": listener},
            "routes": [
                {"name": "small", "match": {"models": [small]}, "tiers": [[small]]},
                {"name": "large", "match": {"models": [large]}, "tiers": [[large]]},
            ],
            "virtualModels": [
                {"name": virtual["name"], "small": small, "large": large}
                | {k: v for k, v in virtual.items() if k != "name"}
            ],
        },
    }
    return [pool(small), pool(large), policy]
