"""Fuzz every REST route: no input may cause a 5xx.

Routes are read from ``/openapi.json``, so a new route is fuzzed without editing this file.
Requests are schema-driven (valid objects with one part replaced by random JSON, which reaches
deeper validation than pure noise) or random JSON, plus hand-made nasties: nesting depth, size,
text encodings, duplicate keys, NaN and huge numbers, and hostile path parameters. Names,
If-Match headers and query parameters vary too. Requests go in concurrent batches; the run
sends at least `MIN_REQUESTS` and checks that every answer is a 4xx or less, with a ``detail``
when it is an error.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from harness.api import Harness, running_api
from harness.builders import fleet, policy, pool
from harness.wait import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.context import MAX_BODY_BYTES
from controlplane.local import EmbeddedEtcd

pytestmark = pytest.mark.e2e

MIN_REQUESTS = int(os.environ.get("KVPILOT_FUZZ_REQUESTS", "5000"))
"""At least this many requests per run (the environment variable shortens a local try)."""
BATCH = 12
"""Requests per generated example, sent concurrently."""

ENDPOINT = {"address": "127.0.0.1", "port": 8001, "weight": 3}
VALID: dict[str, dict[str, Any]] = {
    "/v1/pools": pool("chat"),
    "/v1/routingpolicies": policy("main"),
    "/v1/fleets": fleet("f"),
    "endpoints": ENDPOINT,
    "weight": {"weight": 5},
}

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
    st.sampled_from(
        [
            "chat",
            "main",
            "f",
            "x",
            "a.b",
            "default",
            "127.0.0.1:8001",
            "[::1]:8001",
            "-bad",
            "UPPER",
            "é",
            "%",
            " ",
            "..",
            ".",
            "a/b",
            "\x00",
            "p" * 64,
            "e" * 300,
            "\u202e",
            "con",
        ]
    ),
    st.text(min_size=1, max_size=70),
)
if_match = st.one_of(
    st.none(),
    st.sampled_from(['"1"', "*", 'W/"2"', "abc", '"999999999999"', "", '"-1"', "9" * 400]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=8),
)
NASTY_BODIES: list[bytes] = [
    b"NaN",
    b'{"kind": "Pool", "x": Infinity}',
    b'{"kind": "Pool", "x": -Infinity}',
    b'{"spec": {"connectTimeout": 1e999}}',
    b'{"weight": 1e400}',
    b'{"weight": ' + b"9" * 5_000 + b"}",
    b'{"weight": 18446744073709551617}',
    b"{",
    b"\xff",
    b"",
    b"   ",
    b"null",
    b"[]",
    b'"string"',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    b'{"spec": ' + b"[" * 70 + b"]" * 70 + b"}",
    b'{"kind": "Pool", "kind": "Fleet"}',
    b'{"metadata": {"name": "a"}, "metadata": {"name": "b"}}',
    b'\xef\xbb\xbf{"kind": "Pool", "metadata": {"name": "bom"}}',
    json.dumps(pool("utf16")).encode("utf-16"),
    json.dumps(pool("utf32")).encode("utf-32"),
    b'{"kind": "Pool", "metadata": {"name": "caf\xe9"}}',
    b'{"kind": "Pool", "metadata": {"name": "\\ud800"}}',
    b'{"kind": "Pool", "metadata": {"name": "a\\u0000b"}}',
    json.dumps({**ENDPOINT, "port": 2**63}).encode(),
    json.dumps({**ENDPOINT, "address": "x" * 10_000}).encode(),
    b'{"x": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}',
]


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


def _valid_for(template: str) -> dict[str, Any]:
    if template.endswith("/weight"):
        return VALID["weight"]
    if "/endpoints/" in template:
        return VALID["endpoints"]
    return next((v for p, v in VALID.items() if template.startswith(p)), {})


@st.composite
def requests(draw: st.DrawFn, routes: list[tuple[str, str]]) -> dict[str, Any]:
    method, template = draw(st.sampled_from(routes))
    url = re.sub(r"\{[^}]+\}", lambda _: urllib.parse.quote(draw(names), safe=""), template)
    request: dict[str, Any] = {"method": method, "url": url, "params": {}, "headers": {}}
    if draw(st.integers(0, 9)) == 0:
        # Rarely: a dry run compiles everything stored, the costliest answer there is.
        request["params"]["dryRun"] = draw(st.sampled_from(["true", "false", "1", "maybe"]))
    if draw(st.integers(0, 4)) == 0:
        request["params"]["ttl"] = draw(st.sampled_from(["0", "1", "-5", "x", "9" * 30, "60"]))
    header = draw(if_match)
    if header is not None:
        request["headers"]["If-Match"] = header
    if draw(st.integers(0, 5)) == 0:
        request["headers"]["Content-Type"] = draw(
            st.sampled_from(["text/plain", "application/json; charset=latin-1", "", "*/*"])
        )
    if method in ("POST", "PUT"):
        valid = _valid_for(template)
        choice = draw(st.integers(0, 9))
        if choice < 2:
            request["content"] = draw(st.sampled_from(NASTY_BODIES))
        elif choice < 4:
            request["json"] = draw(json_values)
        elif choice < 9 and valid:
            request["json"] = draw(mutated(valid))
        else:
            request["json"] = valid
    elif draw(st.integers(0, 9)) == 0:
        request["content"] = draw(st.sampled_from(NASTY_BODIES))  # a body nobody reads
    return request


@pytest.fixture
def api(
    etcd: EmbeddedEtcd, etcd_prefix: str
) -> Iterator[tuple[Harness, asyncio.AbstractEventLoop]]:
    """The harness on an event loop in a thread, so the sync hypothesis test can call it (and
    shrink failures) with ``run_coroutine_threadsafe``. Rebuilds are debounced for longer
    than in other API tests: the fuzz is about answers, and the rebuilds still run."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    context = running_api(etcd.endpoint, etcd_prefix, quiet_period=1.0, max_wait=5.0)
    harness = asyncio.run_coroutine_threadsafe(context.__aenter__(), loop).result(30)
    # Before the first snapshot /readyz rightly answers 503: fuzz the daemon once it is ready.
    wait_until(lambda: harness.reconciler.ready, 30, message="the first snapshot")
    yield harness, loop
    asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


# Some 30 s of CPU; the generous timeout is for a shared, oversubscribed machine (it only
# guards against a hang).
@pytest.mark.timeout(900)
def test_every_route_answers_hostile_input_without_a_5xx(
    api: tuple[Harness, asyncio.AbstractEventLoop],
) -> None:
    harness, loop = api

    def call(batch: list[dict[str, Any]]) -> list[httpx.Response]:
        async def send() -> list[httpx.Response]:
            return list(await asyncio.gather(*(harness.http.request(**r) for r in batch)))

        return asyncio.run_coroutine_threadsafe(send(), loop).result(60)

    schema = call([{"method": "GET", "url": "/openapi.json"}])[0].json()
    routes = sorted(
        (method.upper(), path)
        for path, operations in schema["paths"].items()
        for method in operations
    )
    assert len(routes) >= 21, routes
    sent = 0

    @settings(
        max_examples=MIN_REQUESTS // BATCH + 20,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )
    @given(batch=st.lists(requests(routes), min_size=BATCH, max_size=BATCH))
    def check(batch: list[dict[str, Any]]) -> None:
        nonlocal sent
        for request, response in zip(batch, call(batch), strict=True):
            sent += 1
            assert response.status_code < 500, (request, response.status_code, response.text)
            if response.status_code >= 400 and request["url"] != "/metrics":
                assert "detail" in response.json(), (request, response.text)

    check()
    # Nothing hostile stopped the daemon's rebuilds either.
    assert harness.reconciler.ready
    assert sent >= MIN_REQUESTS, sent
