"""The usage filter's price probe (`bench.cost.filterprice`): each side's Envoy config is what
it says (and valid to Envoy), a tiny run through real Envoys and a simulated replica counts
every answer on the side with the filter and none on the side without it, and its typed
results read back from their JSON. No timing asserts: the numbers are the probe's to report."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.cost.filterprice import (
    CHUNK_LOOP,
    SIDES,
    AnswerCost,
    FilterPrice,
    accounting_fleet,
    measure,
    side_bootstrap,
)
from bench.rig.probe import Timings
from controlplane.local import find_binary
from replicasim.simulator import SimConfig
from xdsserver.translate.usage import USAGE_FILTER, USAGE_LUA


def _usage_sources(bootstrap: dict[str, Any]) -> list[str]:
    """The Lua source of every accounting filter in the bootstrap's listeners."""
    return [
        http_filter["typed_config"]["default_source_code"]["inline_string"]
        for listener in bootstrap["static_resources"]["listeners"]
        for chain in listener["filter_chains"]
        for network in chain["filters"]
        for http_filter in network.get("typed_config", {}).get("http_filters", [])
        if http_filter["name"] == USAGE_FILTER
    ]


@pytest.mark.parametrize(
    ("side", "sources"),
    [("with_filter", [USAGE_LUA]), ("without", []), ("chunk_loop", [CHUNK_LOOP])],
)
def test_each_side_has_the_filter_it_names_and_envoy_accepts_it(
    side: str, sources: list[str], tmp_path: Path
) -> None:
    bootstrap = side_bootstrap(side, accounting_fleet(10000, 8000), 9000, 9001)
    assert _usage_sources(bootstrap) == sources
    config = tmp_path / "envoy.json"
    config.write_text(json.dumps(bootstrap))
    done = subprocess.run(
        [str(find_binary("envoy")), "--mode", "validate", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_side_it_does_not_know_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="side: 'half'"):
        side_bootstrap("half", accounting_fleet(10000, 8000), 9000, 9001)


def test_the_results_read_back_from_their_json() -> None:
    timings = Timings(median_ms=90.0, p99_ms=101.0, cpu_us_per_request=3400.0)
    streamed = AnswerCost(timings, timings, events_per_response=46.0, chunk_loop=timings)
    price = FilterPrice(
        600,
        8,
        {"streamed": streamed, "JSON": AnswerCost(timings, timings, 0.0)},
        answered={"without": 640, "with_filter": 640},
        counted={"without": 0, "with_filter": 640},
    )
    data = json.loads(json.dumps(price.to_json()))
    assert "chunk_loop" not in data["answers"]["JSON"]
    assert FilterPrice.from_json(data) == price


@pytest.mark.e2e
def test_a_tiny_run_counts_every_answer_with_the_filter_and_none_without() -> None:
    price = measure(4, clients=2, sim=SimConfig(stream_interval=0.01, time_scale=0.25))
    assert price.requests == 4 and set(price.answers) == {"streamed", "JSON"}
    assert set(price.answered) == set(SIDES[:2])
    assert price.counted == {"without": 0, "with_filter": price.answered["with_filter"]}
    # Warm-up (2 a client) and the measured requests, both kinds, and the first of each client.
    assert price.answered["with_filter"] == 2 * (2 * 2 + 4) + 2
    streamed = price.answers["streamed"]
    assert streamed.chunk_loop is None
    # 64 tokens arrive over several events (the role, the text, the finish, [DONE]).
    assert streamed.events_per_response > 4
    for cost in price.answers.values():
        for timing in (cost.without, cost.with_filter):
            assert 0 < timing.median_ms <= timing.p99_ms
