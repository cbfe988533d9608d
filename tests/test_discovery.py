"""Reading what a server serves (its model list, vLLM's adapter gauge) and the simulated
replica's LoRA slots."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from replicasim.lora import LoraSlots, UnknownAdapter
from signals.discovery import Discovered, DiscoveryError, lora_adapters, parse_models
from signals.telemetry import TelemetryRecord
from signals.writeband import WriteBand

VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "llama", "object": "model", "root": "llama", "parent": None},
        {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "llama"},
        {"id": "chat-lora", "object": "model", "root": "/adapters/chat", "parent": "llama"},
    ],
}


@pytest.mark.parametrize(
    ("format", "payload", "expected"),
    [
        ("vllm", VLLM_MODELS, Discovered(("llama",), ("chat-lora", "sql-lora"))),
        ("sglang", {"data": [{"id": "qwen", "object": "model"}]}, Discovered(("qwen",), ())),
        (
            "tgi",
            {"model_id": "bigscience/bloom", "max_input_tokens": 1024},
            Discovered(("bigscience/bloom",)),
        ),
        # An entry whose parent is itself is a base model (some servers do that).
        ("vllm", {"data": [{"id": "m", "parent": "m"}]}, Discovered(("m",), ())),
    ],
)
def test_a_model_list_gives_models_and_adapters(
    format: str, payload: Any, expected: Discovered
) -> None:
    assert parse_models(format, payload) == expected


@pytest.mark.parametrize(
    ("format", "payload", "message"),
    [
        ("vllm", {"object": "list"}, "no 'data' list"),
        ("vllm", [1, 2], "no 'data' list"),
        ("vllm", {"data": [{"name": "x"}]}, "no 'id' string"),
        ("tgi", {"model": "x"}, "no 'model_id'"),
    ],
)
def test_a_broken_model_list_is_an_error_that_says_what_is_wrong(
    format: str, payload: Any, message: str
) -> None:
    with pytest.raises(DiscoveryError, match=message):
        parse_models(format, payload)


def test_vllm_lora_gauge_names_running_and_waiting_adapters_of_its_newest_series() -> None:
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="8",running_lora_adapters="old",'
        'waiting_lora_adapters=""} 100.0\n'
        'vllm:lora_requests_info{max_lora="8",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"} 200.0\n'
    )
    assert lora_adapters(text) == ("a", "b", "c")
    assert lora_adapters("vllm:num_requests_running 1\n") is None


def test_a_change_of_served_models_is_always_written() -> None:
    band = WriteBand()
    before = TelemetryRecord(at=1, waiting=3, models=("m",), adapters=("a",))
    assert not band.moved(before, before.model_copy(update={"at": 2}))
    assert band.moved(before, before.model_copy(update={"adapters": ("a", "b")}))
    assert band.moved(before, before.model_copy(update={"models_error": "GET ...: 500"}))


async def test_lora_slots_load_on_demand_evict_the_least_recently_used_idle_one() -> None:
    slots = LoraSlots(catalog=frozenset("abc"), max_loaded=2, load_time=0.01)
    assert await slots.acquire("a") is True  # a load
    slots.release("a")
    assert await slots.acquire("a") is False  # already loaded
    slots.release("a")
    await slots.acquire("b")
    slots.release("b")
    await slots.acquire("c")  # evicts a, the least recently used
    assert list(slots.loaded) == ["b", "c"] and slots.loads == 3
    with pytest.raises(UnknownAdapter):
        await slots.acquire("zzz")


async def test_lora_slots_never_evict_an_adapter_in_use_a_request_waits_for_a_slot() -> None:
    slots = LoraSlots(catalog=frozenset("ab"), max_loaded=1, load_time=0.01)
    await slots.acquire("a")
    waiter = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0.05)
    assert not waiter.done() and "b" not in slots.loaded
    assert 'waiting_lora_adapters="b"' in "\n".join(slots.metrics_lines())
    slots.release("a")
    async with asyncio.timeout(5):
        assert await waiter is True
    assert list(slots.loaded) == ["b"]


def test_lora_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="unknown LoRA setting 'maxLoras'"):
        LoraSlots.from_config({"maxLoras": 3})
    with pytest.raises(ValueError, match="not in this replica's catalog"):
        LoraSlots.from_config({"catalog": ["a"], "loaded": ["b"]})
