"""Prompt-prefix affinity's fields and the Lua they become (the real Envoy runs it in
tests/test_e2e_prefix_affinity.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from policies.models import Route
from xdsserver.translate import prefix_key_lua


def _route(**affinity: Any) -> Route:
    return Route.model_validate({"name": "r", "tiers": [["p"]], "sessionAffinity": affinity})


def test_spreading_hot_prefixes_without_prefix_hashing_is_refused_with_the_field_named() -> None:
    with pytest.raises(ValidationError, match=r"hotPrefixShare .* needs prefixHashChars"):
        _route(hotPrefixShare=10)


@pytest.mark.parametrize("share", [-1, 101])
def test_a_hot_prefix_share_outside_a_percent_is_refused(share: int) -> None:
    with pytest.raises(ValidationError, match="hotPrefixShare"):
        _route(prefixHashChars=1024, hotPrefixShare=share)


def test_the_lua_counts_and_spreads_prefixes_only_when_asked() -> None:
    affinity = _route(prefixHashChars=1024, hotPrefixShare=13).session_affinity
    assert affinity is not None and affinity.hot_prefix_share == 13
    plain = prefix_key_lua("x-session-id", 1024)
    spread = prefix_key_lua("x-session-id", 1024, affinity.hot_prefix_share)
    # Without a share the script is the one every prefix-hashing route had before.
    assert "share(" not in plain and "math.random" not in plain
    assert "local function share(key)" in spread
    assert "math.ceil(share(key) * 100 / 13 - 1e-9)" in spread
    # Both set the same header from the same hash; the spread only suffixes it.
    for script in (plain, spread):
        assert 'handle:headers():add("x-kvpilot-prefix-key", key)' in script
