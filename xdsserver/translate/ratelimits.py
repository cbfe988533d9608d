"""Envoy local rate limits: a route's token bucket (one per tenant when the limit names a
tenant header), a service class's budget with each tenant's share, and a counter that
enforces nothing (it counts shed requests, which leave no route stats)."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2
from envoy.type.v3 import percent_pb2, token_bucket_pb2
from google.protobuf import wrappers_pb2

from policies.models import ClassBudget, RateLimit
from xdsserver.translate.protos import duration

TENANT_DESCRIPTOR = "tenant"
MAX_TENANTS = 10_000
"""Most distinct tenant buckets one route keeps per Envoy (least recently used are dropped)."""
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600}


def rate_limit(limit: RateLimit, stat_name: str) -> local_rate_limit_pb2.LocalRateLimit:
    """A token bucket per route, or per tenant header value when the limit names one.

    Tenant buckets are dynamic descriptors: an entry with an empty value matches any value and
    each distinct value gets its own bucket of the same size.
    """
    bucket = _token_bucket(limit)
    always = percent_pb2.FractionalPercent(
        numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED
    )
    config = local_rate_limit_pb2.LocalRateLimit(
        stat_prefix="rate_limit",
        token_bucket=bucket,
        filter_enabled=base_pb2.RuntimeFractionalPercent(default_value=always),
        filter_enforced=base_pb2.RuntimeFractionalPercent(default_value=always),
        enable_x_ratelimit_headers=ratelimit_pb2.DRAFT_VERSION_03,
    )
    if limit.tenant_header:
        config.rate_limits.append(
            route_components_pb2.RateLimit(
                actions=[
                    route_components_pb2.RateLimit.Action(
                        request_headers=route_components_pb2.RateLimit.Action.RequestHeaders(
                            header_name=limit.tenant_header,
                            descriptor_key=TENANT_DESCRIPTOR,
                            skip_if_absent=True,
                        )
                    )
                ]
            )
        )
        config.descriptors.append(
            ratelimit_pb2.LocalRateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=TENANT_DESCRIPTOR, value="")],
                token_bucket=_token_bucket(limit),
            )
        )
        config.max_dynamic_descriptors.value = MAX_TENANTS
        # A tenant's request spends only its own bucket; requests without the header share
        # the route's bucket.
        config.always_consume_default_token_bucket.value = False
    return config


def class_budget(
    budget: ClassBudget, tenant_header: str, stat_prefix: str
) -> local_rate_limit_pb2.LocalRateLimit:
    """A class's budget as a token bucket, and each tenant's share of it as a bucket of its
    own (dynamic descriptors, as for a route's tenant buckets). A tenant's request spends
    from its own bucket and from the class's, so no tenant takes more than its share and the
    tenants together no more than the budget."""
    limit = RateLimit(
        requests=budget.requests,
        unit=budget.unit,
        burst=budget.burst,
        tenant_header=tenant_header,
    )
    share = RateLimit(
        requests=max(1, budget.requests * budget.tenant_share // 100),
        unit=budget.unit,
        burst=max(1, (budget.burst or budget.requests) * budget.tenant_share // 100),
    )
    config = rate_limit(limit, f"{stat_prefix}.budget")
    config.stat_prefix = f"{stat_prefix}.budget"
    del config.descriptors[:]
    config.descriptors.append(
        ratelimit_pb2.LocalRateLimitDescriptor(
            entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=TENANT_DESCRIPTOR, value="")],
            token_bucket=_token_bucket(share),
        )
    )
    config.always_consume_default_token_bucket.value = True
    return config


def _token_bucket(limit: RateLimit) -> token_bucket_pb2.TokenBucket:
    return token_bucket_pb2.TokenBucket(
        max_tokens=limit.burst or limit.requests,
        tokens_per_fill=wrappers_pb2.UInt32Value(value=limit.requests),
        fill_interval=duration(_UNIT_SECONDS[limit.unit]),
    )


def counter(stat_prefix: str) -> local_rate_limit_pb2.LocalRateLimit:
    """A local rate limit that checks every request and enforces on none: a request counter."""
    return local_rate_limit_pb2.LocalRateLimit(
        stat_prefix=stat_prefix,
        token_bucket=token_bucket_pb2.TokenBucket(
            max_tokens=1,
            tokens_per_fill=wrappers_pb2.UInt32Value(value=1),
            fill_interval=duration(3600),
        ),
        filter_enabled=base_pb2.RuntimeFractionalPercent(
            default_value=percent_pb2.FractionalPercent(
                numerator=100, denominator=percent_pb2.FractionalPercent.HUNDRED
            )
        ),
        filter_enforced=base_pb2.RuntimeFractionalPercent(
            default_value=percent_pb2.FractionalPercent(
                numerator=0, denominator=percent_pb2.FractionalPercent.HUNDRED
            )
        ),
    )
