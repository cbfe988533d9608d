"""`kvpilot status` as text: what an operator reads about each Envoy."""

from __future__ import annotations

import io

from commands.cli.status import _print_status


def envoy(node: str, warming: dict[str, object] | None) -> dict[str, object]:
    return {
        "node_id": node,
        "fleet": "default",
        "mode": "sotw",
        "warming": warming,
        "types": {"c": {"type": "CDS", "version_acked": "v1", "last_nack": None}},
    }


def test_an_envoy_warming_new_clusters_is_named_with_them() -> None:
    status = {
        "envoys": [
            envoy("edge-1", {"clusters": ["chat", "chat-affinity"], "since": 1_796_630_000.0}),
            envoy("edge-2", None),
        ]
    }
    out = io.StringIO()
    _print_status(status, "text", out)
    warming = [line for line in out.getvalue().splitlines() if line.startswith("warming:")]
    assert warming == [
        "warming: edge-1 since 2026-12-07 07:53:20: chat, chat-affinity (its route changes wait)"
    ]
