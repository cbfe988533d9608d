"""`kvpilot agent` against a real etcd and a tiny backend whose /metrics the test controls."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from harness.agent import MetricsBackend, start_agent_process
from harness.wait import poll

from commands.agent import add_arguments, config_from_args
from controlplane.agent.scrape import Agent, AgentConfig, Target
from controlplane.etcd import EtcdClient, KeyValue
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd

pytestmark = pytest.mark.e2e

T = TypeVar("T")


@pytest.fixture
async def store(etcd: EmbeddedEtcd, etcd_prefix: str) -> AsyncIterator[Store]:
    client = EtcdClient([etcd.endpoint])
    await client.connect()
    yield Store(client, etcd_prefix)
    await client.close()


async def get(store: Store, relative: str) -> KeyValue | None:
    return await store.client.get(store.keys.absolute(relative))


async def body(store: Store, relative: str) -> dict[str, Any] | None:
    kv = await get(store, relative)
    return json.loads(kv.value) if kv is not None else None


async def test_agent_writes_telemetry_and_registration_under_one_lease(
    store: Store, metrics_backends: Callable[..., MetricsBackend]
) -> None:
    backend = metrics_backends(waiting=3, kv=0.25)
    target = Target(pool="llama", url=backend.url)
    config = AgentConfig([], [target], interval=0.1, ttl=5, register=True)
    agent = Agent(store, config)
    task = asyncio.create_task(agent.run())
    try:
        telemetry_key = f"telemetry/llama/127.0.0.1:{backend.port}"
        record = await poll(lambda: body(store, telemetry_key), message="telemetry")
        assert (record["waiting"], record["kv_cache"], record["format"]) == (3, 0.25, "vllm")
        assert abs(record["at"] - time.time()) < 5
        endpoint = await body(store, f"endpoints/llama/127.0.0.1:{backend.port}")
        assert endpoint == {"address": "127.0.0.1", "port": backend.port, "weight": 100}
        leases = {
            kv.lease
            for key in (telemetry_key, f"endpoints/llama/127.0.0.1:{backend.port}")
            if (kv := await get(store, key)) is not None
        }
        assert leases == {agent.lease_id} and agent.lease_id != 0

        backend.waiting = 9

        async def updated() -> bool:
            current = await body(store, telemetry_key)
            return current is not None and current["waiting"] == 9

        await poll(updated, message="the new queue depth to reach etcd")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # A clean exit revokes the lease: the keys go at once.
    assert await get(store, f"telemetry/llama/127.0.0.1:{backend.port}") is None
    assert await get(store, f"endpoints/llama/127.0.0.1:{backend.port}") is None


async def test_an_unchanged_record_is_rewritten_only_every_refresh(
    store: Store, metrics_backends: Callable[..., MetricsBackend]
) -> None:
    backend = metrics_backends(waiting=1)
    config = AgentConfig([], [Target(pool="p", url=backend.url)], interval=0.05, refresh=60)
    agent = Agent(store, config)
    task = asyncio.create_task(agent.run())
    try:

        async def many_scrapes() -> bool:
            return agent.scrapes >= 10

        await poll(many_scrapes)
        kv = await get(store, f"telemetry/p/127.0.0.1:{backend.port}")
        assert kv is not None and kv.version == 1, "the same numbers were written again"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_speed_change_is_written_with_the_two_records_after_it_then_held(
    store: Store, metrics_backends: Callable[..., MetricsBackend]
) -> None:
    """Capacity weights act on two slow records in a row, and the first record after a
    slowdown may still hold time from before it: the agent writes the record that moved the
    time per output token and the two after it, then holds until something moves again."""
    backend = metrics_backends()
    backend.tpot = 0.03
    # No model list read: this backend has none, and a read that fails otherwise than with
    # its 404 (a timeout on a loaded machine) moves the record's models_error, a write of
    # its own among those counted here.
    target = Target(pool="p", url=backend.url, models_path="")
    config = AgentConfig([], [target], interval=0.05, refresh=60)
    agent = Agent(store, config)
    key = f"telemetry/p/127.0.0.1:{backend.port}"
    task = asyncio.create_task(agent.run())
    try:

        async def scrapes_past(count: int) -> bool:
            return agent.scrapes >= count

        await poll(lambda: scrapes_past(10))
        steady = await get(store, key)
        assert steady is not None
        record = json.loads(steady.value)
        assert record["time_per_output_token"] == pytest.approx(0.03)
        backend.tpot = 0.09
        later = agent.scrapes + 10
        await poll(lambda: scrapes_past(later))
        slowed = await get(store, key)
        assert slowed is not None
        assert json.loads(slowed.value)["time_per_output_token"] == pytest.approx(0.09)
        assert slowed.version == steady.version + 3, "the move and the two after it, no more"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_failing_backend_is_withdrawn_and_registered_again_when_it_answers(
    store: Store, metrics_backends: Callable[..., MetricsBackend]
) -> None:
    backend = metrics_backends()
    config = AgentConfig(
        [], [Target(pool="p", url=backend.url)], interval=0.05, register=True, unregister_after=3
    )
    agent = Agent(store, config)
    task = asyncio.create_task(agent.run())
    key = f"endpoints/p/127.0.0.1:{backend.port}"
    try:
        await poll(lambda: get(store, key), message="registration")
        backend.status = 503

        async def gone() -> bool:
            return await get(store, key) is None and (
                await get(store, f"telemetry/p/127.0.0.1:{backend.port}") is None
            )

        await poll(gone, message="the failing backend to be withdrawn")
        backend.status = 200
        await poll(lambda: get(store, key), message="registration after recovery")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    ("before", "after"),
    [(200, 200), (200, 503), (503, 200)],
    ids=["writes-telemetry", "withdraws-a-failing-backend", "registers-a-backend-that-answers"],
)
async def test_the_agent_stops_when_its_etcd_client_is_closed(
    store: Store, metrics_backends: Callable[..., MetricsBackend], before: int, after: int
) -> None:
    """A closed client never works again: retrying would keep the agent's exit (or a test's
    teardown) waiting on a loop whose cancellation a gRPC call swallowed. Each case meets the
    closed client on another of the agent's writes: the backend's status before and after."""
    backend = metrics_backends()
    backend.status = before
    target = Target(pool="p", url=backend.url)
    # refresh=0: an answering backend's record is written every round.
    config = AgentConfig([], [target], interval=0.05, refresh=0, register=True, unregister_after=1)
    agent = Agent(store, config)
    task = asyncio.create_task(agent.run())
    try:
        await poll(lambda: agent.scrapes >= 1, message="a first round")
        assert target.registered == (before == 200)
        await store.client.close()
        backend.status = after
        async with asyncio.timeout(10):
            await task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_killed_agent_s_keys_expire_with_its_lease(
    store: Store, etcd: EmbeddedEtcd, etcd_prefix: str, metrics_backends: Any
) -> None:
    backend = metrics_backends(waiting=2)
    process = await start_agent_process(etcd.endpoint, etcd_prefix, "p", backend.url)
    keys = [f"endpoints/p/127.0.0.1:{backend.port}", f"telemetry/p/127.0.0.1:{backend.port}"]
    try:

        async def written() -> bool:
            return all([await get(store, key) is not None for key in keys])

        await poll(written, 15, "the agent process to write its keys")
        process.send_signal(signal.SIGKILL)
        await process.wait()
        killed_at = time.monotonic()

        async def expired() -> bool:
            return all([await get(store, key) is None for key in keys])

        # A generous deadline: etcd expires a lease between its TTL and a little more, and
        # later on a busy machine; the time it took is reported, not bounded here.
        await poll(expired, 30, "the lease to expire")
        print(f"the agent's keys went {time.monotonic() - killed_at:.2f}s after SIGKILL (TTL 2 s)")
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "nothing to scrape"),
        (("--backend", "http://10.0.0.1:8000"), "needs --pool"),
        (("--pool", "p", "--backend", "10.0.0.1:8000"), "must look like http://host:port"),
        (("--pool", "p", "--backend", "http://10.0.0.1:8000", "--format", "custom"), "metric-map"),
        (
            ("--pool", "p", "--backend", "http://a:1", "--backend", "http://b:1", "--name", "x"),
            "single --backend",
        ),
    ],
    ids=["no backend", "no pool", "not a URL", "custom without a map", "one name for two"],
)
def test_bad_flags_get_a_sentence(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_args(_args(*argv))


def test_targets_file_and_custom_map(tmp_path: Path) -> None:
    targets = tmp_path / "targets.yaml"
    targets.write_text(
        "- {pool: a, url: 'http://10.0.0.1:8000', weight: 200}\n"
        "- {pool: b, url: 'http://backend.local:9000', address: 10.0.0.2, maxRunning: 64}\n"
    )
    metric_map = tmp_path / "map.yaml"
    metric_map.write_text("waiting: queue_len\nkv_cache: kv_pct\nkv_cache_scale: 0.01\n")
    config = config_from_args(
        _args("--targets-file", str(targets), "--format", "custom", "--metric-map", str(metric_map))
    )
    assert [(t.pool, t.endpoint_id, t.weight, t.max_running) for t in config.targets] == [
        ("a", "10.0.0.1:8000", 200, None),
        ("b", "10.0.0.2:9000", 100, 64),
    ]
    assert config.metric_map is not None and config.metric_map.waiting == ("queue_len",)


def test_a_named_backend_registers_its_name() -> None:
    config = config_from_args(
        _args("--pool", "p", "--backend", "http://10.0.0.1:8000", "--name", "pod-7")
    )
    assert config.targets[0].endpoint_body() == {
        "address": "10.0.0.1",
        "port": 8000,
        "weight": 100,
        "name": "pod-7",
    }


def openai_models(base: str, *adapters: str) -> dict[str, Any]:
    """A vLLM-shaped /v1/models answer: the base model and its loaded adapters."""
    return {
        "object": "list",
        "data": [
            {"id": base, "object": "model", "parent": None},
            *({"id": name, "object": "model", "parent": base} for name in adapters),
        ],
    }


async def test_agent_records_models_and_adapters_and_keeps_them_when_the_list_breaks(
    store: Store, metrics_backends: Callable[..., MetricsBackend]
) -> None:
    backend = metrics_backends()
    backend.models = openai_models("llama", "sql")
    agent = Agent(store, AgentConfig([], [Target(pool="llama", url=backend.url)], interval=0.1))
    task = asyncio.create_task(agent.run())
    key = f"telemetry/llama/127.0.0.1:{backend.port}"

    async def record_where(check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        async def found() -> dict[str, Any] | None:
            current = await body(store, key)
            return current if current is not None and check(current) else None

        return await poll(found, message="the record to change")

    try:
        record = await record_where(lambda r: "models" in r)
        assert (record["models"], record["adapters"]) == (["llama"], ["sql"])
        assert "models_error" not in record
        # An adapter that vLLM's gauge names (a request for it is running) counts as loaded
        # before the model list shows it.
        backend.extra_metrics = (
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="chat",'
            'waiting_lora_adapters=""} 1.0\n'
        )
        record = await record_where(lambda r: r["adapters"] == ["chat", "sql"])
        backend.extra_metrics = ""
        backend.models_status = 500
        record = await record_where(lambda r: "models_error" in r)
        assert (record["models"], record["adapters"]) == (["llama"], ["sql"])
        assert "500" in record["models_error"], record
        backend.models_status = 200
        backend.models = openai_models("llama")
        record = await record_where(lambda r: r["adapters"] == [])
        assert "models_error" not in record
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_agent_reads_the_simulated_replicas_loaded_adapters(
    store: Store, backends: Callable[..., Any]
) -> None:
    process = backends(1, lora={"catalog": ["a", "b"], "loaded": ["a"], "loadTime": 0.01})
    replica = process.replicas[0]
    agent = Agent(store, AgentConfig([], [Target(pool="p", url=replica.url)], interval=0.1))
    task = asyncio.create_task(agent.run())
    key = f"telemetry/p/127.0.0.1:{replica.port}"

    async def adapters(expected: list[str]) -> bool:
        record = await body(store, key)
        return record is not None and record.get("adapters") == expected

    try:
        await poll(lambda: adapters(["a"]), message="adapter a in etcd")
        process.adapters(replica.id, load=["b"], unload=["a"])
        await poll(lambda: adapters(["b"]), message="adapter b instead of a in etcd")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
