"""Bad virtual models get a 422 naming the field, and etcd stays as it was."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from harness.api import Harness
from harness.builders import policy, route

from compiler.difficulty import plan_virtual_models
from policies.models import RoutingPolicy
from policies.validate import PolicyError, parse_object
from xdsserver.translate.difficulty import lua_source

pytestmark = pytest.mark.e2e


def virtual_policy(**virtual: Any) -> dict[str, Any]:
    document = policy(
        "main",
        10000,
        [
            route("small", name="small", match={"models": ["llama-small"]}),
            route("large", name="large", match={"models": ["llama-large"]}),
        ],
    )
    targets = {} if "targets" in virtual else {"small": "llama-small", "large": "llama-large"}
    document["spec"]["virtualModels"] = [{"name": "llama-auto", **targets, **virtual}]
    return document


BAD = [
    pytest.param({"large": "llama-huge"}, "spec.virtualModels[0].large", "llama-huge", id="target"),
    pytest.param(
        {"scorer": {"builtin": {"weights": {"promptTokens": 1, "sentiment": 2}}}},
        "spec.virtualModels[0].scorer.builtin.weights",
        "sentiment",
        id="weights",
    ),
    pytest.param({"share": 120}, "spec.virtualModels[0].share", "0 to 100", id="share-high"),
    pytest.param({"share": -1}, "spec.virtualModels[0].share", "0 to 100", id="share-low"),
    pytest.param({"share": 50, "cap": 40}, "spec.virtualModels[0].share", "cap", id="over-cap"),
    pytest.param(
        {"escalation": {"retryOn": ["timeout"]}},
        "spec.virtualModels[0].escalation.timeout",
        "timeout above 0",
        id="escalation-timeout",
    ),
    pytest.param({"cap": 101}, "spec.virtualModels[0].cap", "0 to 100", id="cap"),
    pytest.param({"name": "llama-small"}, "spec.virtualModels[0].name", "target", id="name"),
    pytest.param(
        {"scorer": {"type": "external"}},
        "spec.virtualModels[0].scorer.external",
        "url",
        id="no-url",
    ),
    pytest.param(
        {"scorer": {"type": "external", "external": {"url": "ftp://x"}}},
        "spec.virtualModels[0].scorer.external.url",
        "http://",
        id="url",
    ),
    pytest.param(
        {"targets": [{"model": "llama-small"}, {"model": "llama-huge", "share": 20}]},
        "spec.virtualModels[0].targets[1].model",
        "llama-huge",
        id="targets-unknown",
    ),
    pytest.param(
        {"targets": [{"model": "llama-small", "share": 5}, {"model": "llama-large", "share": 20}]},
        "spec.virtualModels[0].targets[0].share",
        "first target",
        id="targets-first-share",
    ),
    pytest.param(
        {
            "targets": [
                {"model": "llama-small"},
                {"model": "llama-medium", "share": 20},
                {"model": "llama-large"},
            ]
        },
        "spec.virtualModels[0].targets[2].share",
        "every target after the first",
        id="targets-some-shares",
    ),
    pytest.param(
        {
            "share": None,
            "targets": [
                {"model": "llama-small"},
                {"model": "llama-medium", "threshold": 0.8},
                {"model": "llama-large", "threshold": 0.6},
            ],
        },
        "spec.virtualModels[0].targets[2].threshold",
        "ascend",
        id="targets-thresholds",
    ),
    pytest.param(
        {
            "small": "llama-other",
            "targets": [{"model": "llama-small"}, {"model": "llama-large", "share": 20}],
        },
        "spec.virtualModels[0].small",
        "leave small out",
        id="targets-and-small",
    ),
    pytest.param(
        {"scorer": {"type": "external", "external": {"url": "http://x/s", "timeout": "5ms"}}},
        "spec.virtualModels[0].scorer.external.timeout",
        "from 10ms to 10s",
        id="budget-low",
    ),
    pytest.param(
        {"scorer": {"type": "external", "external": {"url": "http://x/s", "timeout": "11s"}}},
        "spec.virtualModels[0].scorer.external.timeout",
        "from 10ms to 10s",
        id="budget-high",
    ),
]


@pytest.mark.parametrize(("virtual", "location", "words"), BAD)
def test_a_bad_virtual_model_is_refused_naming_its_field(
    virtual: dict[str, Any], location: str, words: str
) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_object(virtual_policy(**virtual))
    errors = caught.value.errors
    assert any(error.path == location and words in error.message for error in errors), errors


def test_a_good_virtual_model_takes_defaults_for_cap_and_floor() -> None:
    parsed = parse_object(virtual_policy(share=20))
    virtual = parsed.spec.virtual_models[0]  # type: ignore[union-attr]
    assert (virtual.cap_percent, virtual.floor_percent) == (30, 10)


async def test_the_api_refuses_a_bad_virtual_model_and_leaves_etcd_untouched(
    api: Harness,
) -> None:
    good = virtual_policy()
    created = await api.http.post("/v1/routingpolicies", json=good)
    assert created.status_code == 201, created.text
    before = await api.raw("objects/routingpolicies/main")
    for virtual, location, _ in (param.values for param in BAD):
        bad = copy.deepcopy(virtual_policy(**virtual))  # type: ignore[arg-type]
        response = await api.http.put("/v1/routingpolicies/main", json=bad)
        assert response.status_code == 422, response.text
        assert location in [error["loc"] for error in response.json()["detail"]]
    assert await api.raw("objects/routingpolicies/main") == before


def test_escalation_needs_a_single_tier_on_the_small_model_route() -> None:
    document = virtual_policy(escalation={})
    document["spec"]["routes"][0]["tiers"] = [["small"], ["spare"]]
    with pytest.raises(PolicyError) as caught:
        parse_object(document)
    assert any(
        error.path == "spec.virtualModels[0].escalation" and "single tier" in error.message
        for error in caught.value.errors
    ), caught.value.errors


@pytest.mark.parametrize(
    ("budget", "call"),
    [("10ms", 0.007), ("25ms", 0.022), ("50ms", 0.045), ("1s", 0.9)],
)
def test_the_classifier_waits_for_the_budget_less_the_reserve(budget: str, call: float) -> None:
    document = virtual_policy(
        scorer={"type": "external", "external": {"url": "http://x/s", "timeout": budget}}
    )
    parsed = parse_object(document)
    assert isinstance(parsed, RoutingPolicy)
    (virtual,) = plan_virtual_models(parsed, {})
    assert virtual.service is not None
    assert virtual.service.timeout == pytest.approx(call)
    assert virtual.service.budget == pytest.approx(call + max(0.003, 0.1 * virtual.service.budget))
    assert f"text, {round(call * 1000)})" in lua_source(virtual, "x-model")


def test_two_targets_are_small_and_large_spelled_as_a_list() -> None:
    listed = parse_object(
        virtual_policy(
            targets=[{"model": "llama-small"}, {"model": "llama-large", "share": 25}],
        )
    )
    pair = parse_object(virtual_policy(share=25))
    assert isinstance(listed, RoutingPolicy) and isinstance(pair, RoutingPolicy)
    (a,), (b,) = plan_virtual_models(listed, {}), plan_virtual_models(pair, {})
    assert lua_source(a, "x-model") == lua_source(b, "x-model")
    # What the API stores and returns reads back as the same object.
    again = parse_object(listed.model_dump(mode="json", by_alias=True))
    assert again == listed


def test_three_targets_hold_each_share_above_the_first() -> None:
    document = virtual_policy(
        targets=[
            {"model": "llama-small"},
            {"model": "llama-large", "share": 15},
            {"model": "llama-huge", "share": 5},
        ]
    )
    document["spec"]["routes"].append(route("huge", name="huge", match={"models": ["llama-huge"]}))
    parsed = parse_object(document)
    assert isinstance(parsed, RoutingPolicy)
    (virtual,) = parsed.spec.virtual_models
    assert (virtual.small, virtual.large, virtual.share) == ("llama-small", "llama-huge", 5)
    assert [(step.model, step.above) for step in virtual.steps] == [
        ("llama-large", 20),
        ("llama-huge", 5),
    ]
    assert (virtual.cap_percent, virtual.floor_percent) == (30, 10)
