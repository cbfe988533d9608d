"""Overflow driven by the route's arrival rate (``overflow.signal: arrivals``): the policy,
the route's demand from the arrivals log, and the decision (``signals.overflowff``)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policies.models import Overflow

# --------------------------------------------------------------------------- the policy


def test_signal_defaults_to_the_fill_loop() -> None:
    assert Overflow.model_validate({"pools": ["paid"]}).signal == "fill"
    assert Overflow.model_validate({"pools": ["paid"], "signal": "arrivals"}).signal == "arrivals"


def test_arrivals_with_feed_forward_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="feedForward"):
        Overflow.model_validate({"pools": ["paid"], "signal": "arrivals", "feedForward": 0.5})
    # feedForward 0 is its default: nothing to refuse.
    Overflow.model_validate({"pools": ["paid"], "signal": "arrivals", "feedForward": 0})


def test_an_unknown_signal_is_refused() -> None:
    with pytest.raises(ValidationError, match="signal"):
        Overflow.model_validate({"pools": ["paid"], "signal": "ttft"})
