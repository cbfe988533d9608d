"""A cluster's load-balancing policy extensions (``load_balancing_policy``), where Envoy's
``lb_policy`` enum cannot say it: least request over every host, client-side weighted round
robin fed by ORCA, and the model subsets over a policy of their own."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import extension_pb2 as core_extension_pb2
from envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3 import (
    client_side_weighted_round_robin_pb2 as cswrr_pb2,
)
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.subset.v3 import subset_pb2
from google.protobuf.message import Message

from xdsserver.translate.metadata import MODEL_METADATA_KEY
from xdsserver.translate.protos import duration, pack

ORCA_UTILIZATION_METRICS = ("named_metrics.kv_cache_usage_perc",)
"""Used when a report has no ``application_utilization``: vLLM's own ORCA header reports its
KV-cache use as a named metric."""


def full_scan_policy() -> cluster_pb2.LoadBalancingPolicy:
    """Least request over every host of the priority, not the fewer of two drawn at random.

    Envoy draws the two with replacement: of two replicas it takes the busier a quarter of the
    time, and of four the busiest one time in sixteen; a request sent to a replica whose batch
    is full waits there for a slot while another has one free. Replica pools are tens of
    hosts, not thousands, and a request costs seconds of GPU time, so scanning them all is
    cheap. Envoy keeps its weighted schedule where endpoint weights differ (the selection
    method applies to equal weights). The pools' locality weights (a split) are set inside
    the policy, as Envoy asks of a policy extension."""
    config = least_request_pb2.LeastRequest(
        selection_method=least_request_pb2.LeastRequest.FULL_SCAN
    )
    config.locality_lb_config.locality_weighted_lb_config.SetInParent()
    return _policy_extension("envoy.load_balancing_policies.least_request", config)


def orca_policy() -> cluster_pb2.LoadBalancingPolicy:
    """Envoy's client-side weighted round robin: each Envoy weighs hosts by the ORCA load they
    report in ``endpoint-load-metrics`` response headers (weight = qps / utilization), so
    per-request load feedback needs no control-plane round trip.

    Envoy's defaults are tuned for slow-moving services: a 10 s blackout before a new host's
    reports count, recomputed every second. LLM load swings faster; a 1 s blackout and a
    0.5 s update period let weights follow within a couple of seconds while still averaging
    over many responses. Reports older than 60 s expire and the host falls back to the mean
    weight.
    """
    config = cswrr_pb2.ClientSideWeightedRoundRobin(
        blackout_period=duration(1.0),
        weight_update_period=duration(0.5),
        weight_expiration_period=duration(60.0),
        metric_names_for_computing_utilization=list(ORCA_UTILIZATION_METRICS),
    )
    return _policy_extension(
        "envoy.load_balancing_policies.client_side_weighted_round_robin", config
    )


def _policy_extension(name: str, config: Message) -> cluster_pb2.LoadBalancingPolicy:
    """A cluster's ``load_balancing_policy``: the one extension `name` configured by `config`
    (it takes precedence over ``lb_policy``)."""
    return cluster_pb2.LoadBalancingPolicy(
        policies=[
            cluster_pb2.LoadBalancingPolicy.Policy(
                typed_extension_config=core_extension_pb2.TypedExtensionConfig(
                    name=name, typed_config=pack(config)
                )
            )
        ]
    )


def model_subsets_policy(
    within: cluster_pb2.LoadBalancingPolicy,
) -> cluster_pb2.LoadBalancingPolicy:
    """The model subsets (``clusters.model_subsets``: one per model an endpoint lists, any
    endpoint for a model none lists) as Envoy's subset policy extension, each subset
    balanced by `within`, the pools' locality weights (a split) kept inside a subset. A
    policy extension and ``lb_subset_config`` do not combine."""
    config = subset_pb2.Subset(
        fallback_policy=subset_pb2.Subset.ANY_ENDPOINT,
        subset_selectors=[subset_pb2.Subset.LbSubsetSelector(keys=[MODEL_METADATA_KEY])],
        list_as_any=True,
        locality_weight_aware=True,
        subset_lb_policy=within,
    )
    return _policy_extension("envoy.load_balancing_policies.subset", config)


__all__ = ["ORCA_UTILIZATION_METRICS", "full_scan_policy", "model_subsets_policy", "orca_policy"]
