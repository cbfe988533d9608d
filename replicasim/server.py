"""Simulated OpenAI-compatible model replicas, several per process, for tests and the demo.

Each replica (`replicasim.replica`: its endpoints, switches and counters) listens on its own port
and says who it is (`x-backend-id` header and a `backend` field), so tests behind Envoy can
assert which replica answered. With `--simulate` each runs a `replicasim.simulator.Engine`
instead of answering at once.

Run it:  python -m replicasim --replicas 3 --host 127.0.0.1 --ports 0 --id-prefix be
         [--simulate [--sim-config '{"time_scale": 2.0, "orca": true}']]
It prints one JSON line `{"replicas": [{"id": "be-0", "port": 12345}, ...]}` once every replica
listens (`replicasim.group.ServerGroup.announce`), then serves until SIGTERM or SIGINT.
`controlplane.local.replicas.BackendProcess` does that from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from replicasim.group import ServerGroup, UvicornServer
from replicasim.lora import LoraSlots
from replicasim.replica import DEFAULT_MODEL, Replica, build_app
from replicasim.simulator import Engine, SimConfig

# --------------------------------------------------------------------------- serving


async def serve(replicas: Sequence[Replica], host: str, ports: Sequence[int]) -> None:
    """Serve each replica on its port until SIGTERM/SIGINT; announce ports on stdout once up."""
    group = ServerGroup([build_app(replica) for replica in replicas], host, ports)
    engines = [
        asyncio.create_task(replica.engine.run())
        for replica in replicas
        if replica.engine is not None
    ]

    def dying(server: UvicornServer) -> Callable[[], None]:
        def stop() -> None:
            # A dead replica drops its connections instead of draining them.
            server.config.timeout_graceful_shutdown = 0
            server.should_exit = True
            server.force_exit = True

        return stop

    for replica, server in zip(replicas, group.servers, strict=True):
        replica.on_death = dying(server)
    if await group.start():
        group.announce([replica.id for replica in replicas])
    # One replica stopping (a signal, or a crash) stops them all; a replica told to die
    # (`/admin/die`) stops alone.
    pending = set(group.tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(not replicas[group.tasks.index(task)].dead for task in done):
            break
    group.request_exit()
    await group.wait()
    for task in engines:
        task.cancel()
    await asyncio.gather(*engines, return_exceptions=True)


def parse_ports(text: str, replicas: int) -> list[int]:
    ports = [int(p) for p in text.split(",") if p.strip()]
    if ports == [0]:
        return [0] * replicas
    if len(ports) != replicas:
        raise ValueError(f"--ports lists {len(ports)} ports for {replicas} replicas")
    return ports


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m replicasim", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--ports", default="0", help="0 for free ports, or a comma list, one per replica"
    )
    parser.add_argument("--id-prefix", default="be")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--simulate", action="store_true", help="run a simulated vLLM engine per replica"
    )
    parser.add_argument(
        "--sim-config", default="{}", help="SimConfig fields as JSON, with --simulate"
    )
    parser.add_argument(
        "--lora",
        default=None,
        help='LoRA adapters each replica can load, as JSON: {"catalog": [names], '
        '"maxLoaded": 8, "loadTime": 0.3, "loaded": [names]}',
    )
    parser.add_argument("--region", default="", help="region the replicas simulate running in")
    parser.add_argument(
        "--remote-delay",
        type=float,
        default=0.0,
        help="seconds of round trip added to requests from another region (x-client-region)",
    )
    args = parser.parse_args(argv)
    try:
        ports = parse_ports(args.ports, args.replicas)
    except ValueError as exc:
        parser.error(str(exc))
    sim_config = SimConfig.from_json(args.sim_config) if args.simulate else None
    lora: dict[str, Any] | None = None
    if args.lora:
        try:
            lora = json.loads(args.lora)
            LoraSlots.from_config(lora if isinstance(lora, dict) else {})
        except ValueError as exc:
            parser.error(f"--lora: {exc}")
        if not isinstance(lora, dict):
            parser.error("--lora takes a JSON object")

    async def run() -> None:
        # Engines hold asyncio events: create them inside the running loop.
        replicas = [
            Replica(
                id=f"{args.id_prefix}-{i}",
                model=args.model,
                engine=Engine(sim_config, args.model) if sim_config else None,
                lora=LoraSlots.from_config(lora) if lora is not None else None,
                region=args.region,
                remote_delay=args.remote_delay,
            )
            for i in range(args.replicas)
        ]
        await serve(replicas, args.host, ports)

    asyncio.run(run())
    return 0
