"""The Grafana dashboard and the Prometheus alert rules in deploy/ name only metrics that
kvpilot and Envoy really export: checked against a live scrape of both, with traffic flowing
through Envoy and telemetry feeding weights, so the series the queries need exist."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest
import yaml
from harness.builders import FAST_HEALTH_CHECK, chat, policy, pool, route
from harness.rig import api_client
from harness.wait import wait_until
from prometheus_client.parser import text_string_to_metric_families

from controlplane.etcd import EtcdClient
from controlplane.etcd.store import Store
from controlplane.local import free_port, repo_root

pytestmark = pytest.mark.e2e

DEPLOY = repo_root() / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvpilot-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "kvpilot-alerts.yaml"

_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = re.compile(r"\{[^}]*\}")
_NAME = re.compile(r"\b(?:kvpilot|envoy)_[a-zA-Z0-9_]+")


def metric_names(expr: str) -> set[str]:
    """The kvpilot and Envoy metric names a PromQL expression reads (label names in
    groupings and matchers are not metrics)."""
    return set(_NAME.findall(_MATCHERS.sub("", _GROUPING.sub("", expr))))


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


def exported(text: str) -> set[str]:
    """Every series name a scrape offers, families without samples included (a labelled
    counter that never fired has no sample yet, but exists)."""
    names = set()
    suffixes = {"counter": ["_total", ""], "histogram": ["_bucket", "_sum", "_count"]}
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, [""]))
    return names


def test_the_expression_parser_finds_metrics_not_labels() -> None:
    expr = (
        'sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_xx{envoy_cluster_name!="x",'
        'envoy_response_code_class="5"}[5m])) / on (pool) kvpilot_pool_endpoints'
    )
    assert metric_names(expr) == {"envoy_cluster_upstream_rq_xx", "kvpilot_pool_endpoints"}


def test_the_alert_rules_are_well_formed() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in {"page", "warn"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
    # What the operators asked to be woken for.
    wanted = {
        "KvpilotEnvoyNacking",
        "KvpilotTelemetryStale",
        "KvpilotEtcdUnreachable",
        "KvpilotPoolNoHealthyEndpoint",
        "KvpilotFleetOutOfSync",
    }
    assert wanted <= set(names)


def test_every_metric_in_the_dashboard_and_the_alerts_exists_in_a_live_scrape(
    kvpilot_factory: Any, envoy_factory: Any, backends: Any, etcd_prefix: str
) -> None:
    kvpilot = kvpilot_factory(etcd_prefix)
    envoy = envoy_factory(xds_port=kvpilot.xds_port)
    replicas = backends(2, id_prefix="obs")
    ports = [replica.port for replica in replicas.replicas]
    listener = free_port()
    # With session affinity, so the saturation series exist too.
    telemetry_route = route("chat", name="chat", balancing="telemetry", sessionAffinity={})
    with api_client(kvpilot) as api:
        # Priced, so the spend series exist too.
        chat_pool = pool(
            "chat", ports, health_check=FAST_HEALTH_CHECK, price={"input": 1, "output": 2}
        )
        assert api.put("/v1/pools/chat", json=chat_pool).status_code == 201
        p = policy("p", listener, [telemetry_route])
        assert api.put("/v1/routingpolicies/p", json=p).status_code == 201
        # An agent's record, so the telemetry series exist.
        record = {"at": time.time(), "waiting": 2.0, "running": 3.0, "kv_cache": 0.4}

        async def write() -> None:
            client = EtcdClient(kvpilot.etcd_endpoints)
            await client.connect()
            try:
                await Store(client, etcd_prefix).put_telemetry(
                    "chat", f"127.0.0.1:{ports[0]}", record
                )
            finally:
                await client.close()

        asyncio.run(write())
        with httpx.Client(timeout=10) as client:
            wait_until(
                lambda: (
                    client.post(
                        f"http://127.0.0.1:{listener}/v1/chat/completions", json=chat()
                    ).status_code
                    == 200
                ),
                30,
                message="a request to pass through Envoy",
            )
        wait_until(
            lambda: "kvpilot_spend_total{" in api.get("/metrics").text,
            10,
            message="the request's usage to be counted",
        )
        wait_until(
            lambda: "kvpilot_telemetry_weight{" in api.get("/metrics").text,
            10,
            message="telemetry to reach the weights",
        )
        kvpilot_metrics = api.get("/metrics").text
    envoy_metrics = httpx.get(f"{envoy.admin_url}/stats/prometheus", timeout=10).text
    available = exported(kvpilot_metrics) | exported(envoy_metrics)

    named: dict[str, set[str]] = {}
    sources: list[tuple[str, str]] = [("dashboard", query) for query in dashboard_queries()]
    sources += [(f"alert {rule['alert']}", rule["expr"]) for rule in alert_rules()]
    for where, expr in sources:
        for name in metric_names(expr):
            named.setdefault(name, set()).add(where)
    assert len(named) >= 25, sorted(named)
    missing = {name: sorted(where) for name, where in named.items() if name not in available}
    assert not missing, f"metrics that neither kvpilot nor Envoy exports: {missing}"
