"""Fuzz the object routes listed in the OpenAPI schema: no input may cause a 5xx.

Bodies are random JSON, or valid objects with one part replaced by random JSON (which reaches
deeper validation than pure noise); names, If-Match headers and dryRun vary too. The routes are
read from ``/openapi.json``, so a new object route is fuzzed without editing this file.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_harness import Harness, fleet, policy, pool, running_api
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.launchers import EmbeddedEtcd

pytestmark = pytest.mark.e2e

OBJECT_PATHS = ("/v1/pools", "/v1/routingpolicies", "/v1/fleets")
VALID = {"/v1/pools": pool("chat"), "/v1/routingpolicies": policy("main"), "/v1/fleets": fleet("f")}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
names = st.one_of(
    st.sampled_from(["chat", "main", "f", "x", "a.b", "-bad", "UPPER", "é", "%", " "]),
    st.text(min_size=1, max_size=70),
)
if_match = st.one_of(
    st.none(),
    st.sampled_from(['"1"', "*", 'W/"2"', "abc", '"999999999999"', ""]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=8),
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out.extend(_paths(child, (*prefix, key)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            out.extend(_paths(child, (*prefix, index)))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    body = copy.deepcopy(base)
    location = draw(st.sampled_from(_paths(body)[1:]))
    target: Any = body
    for part in location[:-1]:
        target = target[part]
    target[location[-1]] = draw(json_values)
    return body


@st.composite
def requests(draw: st.DrawFn, routes: list[tuple[str, str]]) -> dict[str, Any]:
    method, template = draw(st.sampled_from(routes))
    base_path = next(p for p in OBJECT_PATHS if template.startswith(p))
    name = draw(names)
    url = template.replace("{name}", urllib.parse.quote(name, safe=""))
    request: dict[str, Any] = {"method": method, "url": url, "params": {}, "headers": {}}
    if draw(st.booleans()):
        request["params"]["dryRun"] = draw(st.sampled_from(["true", "false", "1", "maybe"]))
    header = draw(if_match)
    if header is not None:
        request["headers"]["If-Match"] = header
    if method in ("POST", "PUT"):
        body = draw(st.one_of(json_values, mutated(VALID[base_path]), st.just(VALID[base_path])))
        request["json"] = body
        if draw(st.integers(0, 9)) == 0:
            # Python's JSON extensions and broken text, sent raw.
            del request["json"]
            request["content"] = draw(
                st.sampled_from(
                    [
                        b"NaN",
                        b'{"kind": "Pool", "x": Infinity}',
                        b'{"spec": {"connectTimeout": 1e999}}',
                        b"{",
                        b"\xff",
                        b"",
                    ]
                )
            )
    return request


@pytest.fixture
def api(
    etcd: EmbeddedEtcd, etcd_prefix: str
) -> Iterator[tuple[Harness, asyncio.AbstractEventLoop]]:
    """The harness on an event loop in a thread, so the sync hypothesis test can call it (and
    shrink failures) with ``run_coroutine_threadsafe``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    context = running_api(etcd.endpoint, etcd_prefix)
    harness = asyncio.run_coroutine_threadsafe(context.__aenter__(), loop).result(30)
    yield harness, loop
    asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_object_routes_never_answer_5xx(api: tuple[Harness, asyncio.AbstractEventLoop]) -> None:
    harness, loop = api

    def call(**request: Any) -> httpx.Response:
        return asyncio.run_coroutine_threadsafe(harness.http.request(**request), loop).result(30)

    schema = call(method="GET", url="/openapi.json").json()
    routes = [
        (method.upper(), path)
        for path, operations in schema["paths"].items()
        if path.startswith(OBJECT_PATHS) and path.count("/") <= 3
        for method in operations
    ]
    assert len(routes) == 3 * 5

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(request=requests(routes))
    def check(request: dict[str, Any]) -> None:
        response = call(**request)
        assert response.status_code < 500, (request, response.status_code, response.text)
        if response.status_code >= 400:
            assert "detail" in response.json()

    check()
