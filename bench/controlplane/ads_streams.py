"""Simulated xDS clients: `count` SotW ADS streams from one process, each subscribing like an
Envoy and ACKing every response at once (asyncio gRPC, 50 streams per HTTP/2 connection).

    python -m bench.controlplane.ads_streams HOST:PORT COUNT [--eds NAMES] [--rds NAMES]

The control-plane benchmark starts it as a child process (`bench.controlplane`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.controlplane.pools import FLEET

STREAMS_PER_CHANNEL = 50


async def simulated_streams(target: str, count: int, eds: list[str], rds: list[str]) -> None:
    """`count` SotW ADS streams that subscribe like an Envoy and ACK every response at once."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

    from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE

    subscriptions = {CLUSTER: [], ENDPOINT: eds, LISTENER: [], ROUTE: rds}
    channels = [grpc.aio.insecure_channel(target) for _ in range(-(-count // STREAMS_PER_CHANNEL))]

    async def stream(index: int) -> None:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channels[index // STREAMS_PER_CHANNEL])
        call = stub.StreamAggregatedResources()
        node = base_pb2.Node(id=f"stream-{index}", cluster=FLEET)
        for i, (type_url, names) in enumerate(subscriptions.items()):
            request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names)
            if i == 0:
                request.node.CopyFrom(node)
            await call.write(request)
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                return
            await call.write(
                discovery_pb2.DiscoveryRequest(
                    type_url=response.type_url,
                    version_info=response.version_info,
                    response_nonce=response.nonce,
                    resource_names=subscriptions.get(response.type_url, []),
                )
            )

    await asyncio.gather(*(stream(i) for i in range(count)), return_exceptions=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.controlplane.ads_streams")
    parser.add_argument("target")
    parser.add_argument("count", type=int)
    parser.add_argument("--eds", default="")
    parser.add_argument("--rds", default="")
    args = parser.parse_args(argv)
    split = [n for n in args.eds.split(",") if n], [n for n in args.rds.split(",") if n]
    asyncio.run(simulated_streams(args.target, args.count, *split))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
