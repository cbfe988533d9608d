"""A small ADS client for tests: open a SotW or Delta stream, send requests, await responses.

It speaks the protocol the way Envoy does (node on the first request only, ACK/NACK by echoing
the nonce) but leaves every choice to the test, including sending stale nonces.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from harness.wait import poll

DEFAULT_TIMEOUT = 5.0


class _Stream:
    def __init__(
        self, target: str, node_id: str, cluster: str, *, read: bool = True, **channel_opts: Any
    ) -> None:
        self.node = base_pb2.Node(id=node_id, cluster=cluster)
        options = list(channel_opts.items())
        self.channel = grpc.aio.insecure_channel(target, options=options)
        self.stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        self._node_sent = False
        self._responses: asyncio.Queue[Any] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self._read = read
        self.call: Any = None
        self.ended = asyncio.Event()
        self.requests_sent = 0
        """Requests written on this stream so far."""
        self.received = 0
        """Responses read off the wire so far."""
        self.server: RunningServer | None = None
        """The in-process server this stream talks to (`RunningServer.sotw`/`delta`), which
        `expect_silence` asks whether it has anything left to send."""

    def _open(self) -> Any:
        raise NotImplementedError

    async def __aenter__(self) -> _Stream:
        self.call = self._open()
        if self._read:
            self.start_reading()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start_reading(self) -> None:
        """Start pulling responses off the wire (a client built with read=False is 'stuck')."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            while True:
                response = await self.call.read()
                if response is grpc.aio.EOF:
                    break
                self.received += 1
                await self._responses.put(response)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            self.ended.set()

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.channel.close()

    def _with_node(self, request: Any) -> Any:
        self.requests_sent += 1
        # Like Envoy with set_node_on_first_message_only: the node goes on the first request.
        if not self._node_sent:
            request.node.CopyFrom(self.node)
            self._node_sent = True
        return request

    async def recv(self, within: float = DEFAULT_TIMEOUT) -> Any:
        """The next response; fails the test if none arrives within `within` seconds."""
        async with asyncio.timeout(within):
            return await self._responses.get()

    async def recv_type(self, type_url: str, within: float = DEFAULT_TIMEOUT) -> Any:
        """The next response of `type_url`, skipping other types."""
        async with asyncio.timeout(within):
            while True:
                response = await self._responses.get()
                if response.type_url == type_url:
                    return response

    async def expect_silence(self) -> None:
        """Assert that the server sends this stream nothing more: once it has handled every
        request written here and its writer waits for a change with none pending, every
        response it sent has arrived, and none is unread. No quiet period: the server's own
        state says nothing is coming (`RunningServer.idle`)."""
        if self.server is None:
            raise RuntimeError("expect_silence needs a stream opened by RunningServer")
        await self.server.idle(self)
        if not self._responses.empty():
            raise AssertionError(f"unexpected response: {self._responses.get_nowait()}")


class SotwStream(_Stream):
    """A StreamAggregatedResources stream. Use as `async with SotwStream(...) as s:`."""

    def _open(self) -> Any:
        return self.stub.StreamAggregatedResources()

    async def send(
        self,
        type_url: str,
        names: Iterable[str] = (),
        *,
        version: str = "",
        nonce: str = "",
        error: str | None = None,
    ) -> None:
        request = discovery_pb2.DiscoveryRequest(
            type_url=type_url,
            resource_names=list(names),
            version_info=version,
            response_nonce=nonce,
        )
        if error is not None:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        await self.call.write(self._with_node(request))

    async def ack(self, response: Any, names: Iterable[str] = ()) -> None:
        await self.send(
            response.type_url, names, version=response.version_info, nonce=response.nonce
        )

    async def nack(
        self, response: Any, error: str, *, good_version: str = "", names: Iterable[str] = ()
    ) -> None:
        await self.send(
            response.type_url, names, version=good_version, nonce=response.nonce, error=error
        )


class DeltaStream(_Stream):
    """A DeltaAggregatedResources stream. Use as `async with DeltaStream(...) as s:`."""

    def _open(self) -> Any:
        return self.stub.DeltaAggregatedResources()

    async def send(
        self,
        type_url: str,
        subscribe: Iterable[str] = (),
        unsubscribe: Iterable[str] = (),
        *,
        nonce: str = "",
        initial_versions: Mapping[str, str] | None = None,
        error: str | None = None,
    ) -> None:
        request = discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url,
            resource_names_subscribe=list(subscribe),
            resource_names_unsubscribe=list(unsubscribe),
            response_nonce=nonce,
            initial_resource_versions=dict(initial_versions or {}),
        )
        if error is not None:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        await self.call.write(self._with_node(request))

    async def ack(self, response: Any) -> None:
        await self.send(response.type_url, nonce=response.nonce)

    async def nack(self, response: Any, error: str) -> None:
        await self.send(response.type_url, nonce=response.nonce, error=error)


def names_of(response: Any) -> list[str]:
    """Resource names in a SotW or Delta response, in order (unpacked for SotW)."""
    from xdsserver.resources import resource_name

    if isinstance(response, discovery_pb2.DeltaDiscoveryResponse):
        return [r.name for r in response.resources]
    return [resource_name(unpack(any_msg)) for any_msg in response.resources]


def unpack(any_msg: Any) -> Any:
    """Unpack a google.protobuf.Any holding one of the four ADS types."""
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.endpoint.v3 import endpoint_pb2
    from envoy.config.listener.v3 import listener_pb2
    from envoy.config.route.v3 import route_pb2

    for cls in (
        cluster_pb2.Cluster,
        endpoint_pb2.ClusterLoadAssignment,
        listener_pb2.Listener,
        route_pb2.RouteConfiguration,
    ):
        if any_msg.Is(cls.DESCRIPTOR):
            message = cls()
            any_msg.Unpack(message)
            return message
    raise ValueError(f"unexpected type {any_msg.type_url}")


async def sent_endpoint_weights(
    target: str, cluster: str, *, fleet: str = "default", within: float = 30.0
) -> dict[int, int]:
    """Port -> weight of `cluster`'s endpoints as the control plane at `target` sends them to
    an Envoy of `fleet`: what it decided, before any load balancer in Envoy rewrites weights
    (Envoy's admin pages show the weights its load balancer uses)."""
    from xdsserver.resources import ENDPOINT

    async with SotwStream(target, f"weights-reader-{cluster}", fleet) as stream:
        await stream.send(ENDPOINT, [cluster])
        response = await stream.recv_type(ENDPOINT, within)
    weights = {}
    for resource in response.resources:
        assignment = unpack(resource)
        for group in assignment.endpoints:
            for lb_endpoint in group.lb_endpoints:
                port = lb_endpoint.endpoint.address.socket_address.port_value
                weights[port] = lb_endpoint.load_balancing_weight.value or 1
    return weights


# Small real Envoy resources and a running server, for the ADS tests -----------------------------


def make_cluster(name: str, *, timeout_ms: int = 250, service_name: str = "") -> Any:
    """An EDS cluster fetched over ADS (its ClusterLoadAssignment named `service_name`, if
    given, as kvpilot's affinity twins share their route cluster's)."""
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.core.v3 import config_source_pb2

    c = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.EDS)
    c.connect_timeout.FromMilliseconds(timeout_ms)
    c.eds_cluster_config.eds_config.CopyFrom(
        config_source_pb2.ConfigSource(
            ads=config_source_pb2.AggregatedConfigSource(),
            resource_api_version=config_source_pb2.V3,
        )
    )
    c.eds_cluster_config.service_name = service_name
    return c


def make_endpoints(cluster: str, ports: Iterable[int], *, weight: int = 1) -> Any:
    """A ClusterLoadAssignment with one 127.0.0.1 endpoint per port."""
    from envoy.config.core.v3 import address_pb2
    from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2

    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster)
    locality = cla.endpoints.add()
    for port in ports:
        lb = locality.lb_endpoints.add()
        lb.load_balancing_weight.value = weight
        lb.endpoint.CopyFrom(
            endpoint_components_pb2.Endpoint(
                address=address_pb2.Address(
                    socket_address=address_pb2.SocketAddress(address="127.0.0.1", port_value=port)
                )
            )
        )
    return cla


def make_route(name: str, cluster: str) -> Any:
    """A RouteConfiguration sending everything to one cluster."""
    from envoy.config.route.v3 import route_components_pb2, route_pb2

    return route_pb2.RouteConfiguration(
        name=name,
        virtual_hosts=[
            route_components_pb2.VirtualHost(
                name="all",
                domains=["*"],
                routes=[
                    route_components_pb2.Route(
                        match=route_components_pb2.RouteMatch(prefix="/"),
                        route=route_components_pb2.RouteAction(cluster=cluster),
                    )
                ],
            )
        ],
    )


def make_listener(name: str, route: str, *, port: int = 10000) -> Any:
    """An HTTP listener whose routes come from RDS over ADS."""
    from envoy.config.core.v3 import address_pb2, config_source_pb2
    from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
    from envoy.extensions.filters.http.router.v3 import router_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from google.protobuf import any_pb2

    hcm = hcm_pb2.HttpConnectionManager(stat_prefix=name)
    hcm.rds.route_config_name = route
    hcm.rds.config_source.CopyFrom(
        config_source_pb2.ConfigSource(
            ads=config_source_pb2.AggregatedConfigSource(),
            resource_api_version=config_source_pb2.V3,
        )
    )
    router = any_pb2.Any()
    router.Pack(router_pb2.Router())
    hcm.http_filters.add(name="envoy.filters.http.router", typed_config=router)
    hcm_any = any_pb2.Any()
    hcm_any.Pack(hcm)
    return listener_pb2.Listener(
        name=name,
        address=address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address="127.0.0.1", port_value=port)
        ),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=hcm_any,
                    )
                ]
            )
        ],
    )


def make_messages(
    clusters: Mapping[str, Iterable[int]], *, listener_port: int = 10000, route_to: str = ""
) -> dict[str, list[Any]]:
    """CDS/EDS/LDS/RDS messages for clusters (name → endpoint ports): one listener "ingress"
    with route config "ingress-routes" sending everything to `route_to` (default: first cluster)."""
    from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE

    target = route_to or next(iter(clusters), "none")
    return {
        CLUSTER: [make_cluster(name) for name in clusters],
        ENDPOINT: [make_endpoints(name, ports) for name, ports in clusters.items()],
        LISTENER: [make_listener("ingress", "ingress-routes", port=listener_port)],
        ROUTE: [make_route("ingress-routes", target)],
    }


def make_snapshot(clusters: dict[str, Iterable[int]], **kw: Any) -> Any:
    """`make_messages` as a Snapshot."""
    from xdsserver.snapshot import Snapshot

    return Snapshot.from_messages(make_messages(clusters, **kw))


def assert_well_formed(response: Any) -> Any:
    """`response`, after checking what every ADS response must hold: a nonce, and no
    resource name twice (xDS rules 1 and 8)."""
    names = names_of(response)
    assert len(names) == len(set(names)), f"duplicate names in {names}"
    assert response.nonce
    return response


class _TrackedEvent(asyncio.Event):
    """An Event that knows whether a task waits on it: a stream's writer waits on its watch's
    event when it has sent everything it had to send."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0

    async def wait(self) -> Literal[True]:
        self.waiting += 1
        try:
            return await super().wait()
        finally:
            self.waiting -= 1


@dataclass
class _ServerSide:
    """What the server has done on one stream (by node id): requests handled, responses
    sent, and the watch its writer waits on."""

    watch: Any = None
    handled: int = 0
    sent: int = 0


class RunningServer:
    """A grpc.aio server with an `AdsServer` on 127.0.0.1 and a free port.

    It observes each stream from the server's side (requests handled, responses sent, the
    writer idle), so a test can tell "nothing more is coming" from the server's state rather
    than from a quiet period.
    """

    def __init__(self, cache: Any = None, status: Any = None) -> None:
        from prometheus_client import CollectorRegistry

        from xdsserver.server import AdsServer
        from xdsserver.snapshot import SnapshotCache
        from xdsserver.status import ConnectionRegistry

        self.registry = CollectorRegistry()
        self.cache = cache if cache is not None else SnapshotCache()
        self.status = status if status is not None else ConnectionRegistry(registry=self.registry)
        self.ads = AdsServer(self.cache, self.status)
        self._sides: dict[str, _ServerSide] = {}
        self._observe()
        self.server = grpc.aio.server()
        self.ads.add_to(self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> RunningServer:
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _observe(self) -> None:
        """Count each stream's handled requests and sent responses, and track its writer."""
        watch = self.cache.watch

        def tracked_watch(fleet: str) -> Any:
            made = watch(fleet)
            made.event = _TrackedEvent()
            return made

        self.cache.watch = tracked_watch
        read = self.ads._read

        async def counting_read(requests: Any, stream: Any, watch: Any) -> None:
            side = self._sides.setdefault(stream.conn.node_id, _ServerSide())
            side.watch, side.handled = watch, 1  # the first request: handled before this

            async def counted() -> Any:
                async for request in requests:
                    yield request
                    side.handled += 1  # asked for the next one: this one is handled

            await read(counted(), stream, watch)

        self.ads._read = counting_read  # type: ignore[method-assign]

        def on_event(event: str, conn: Any) -> None:
            if event == "sent":
                self._sides.setdefault(conn.node_id, _ServerSide()).sent += 1

        self.status.add_listener(on_event)

    async def idle(self, stream: _Stream) -> None:
        """Wait until the server has nothing more for `stream`: it handled every request the
        stream wrote, its writer waits on a clear event, and every response it sent has
        been read off the wire."""

        def done() -> bool:
            side = self._sides.get(stream.node.id)
            if side is None or side.watch is None:
                return stream.requests_sent == 0
            event = side.watch.event
            return (
                side.handled == stream.requests_sent
                and not event.is_set()
                and event.waiting > 0
                and stream.received == side.sent
            )

        await poll(done, DEFAULT_TIMEOUT * 6, f"the server to be idle on {stream.node.id}'s stream")

    def metric(self, name: str, **labels: str) -> float:
        """A sample from this server's own Prometheus registry (0 if absent)."""
        return float(self.registry.get_sample_value(name, labels) or 0.0)

    async def stop(self, grace: float = 1.0) -> None:
        self.ads.close()
        await self.server.stop(grace)

    async def settled(self, node_id: str, response: Any) -> None:
        """Wait until the server has processed the ACK of `response` from `node_id`: a test
        that changes the snapshot right after sending an ACK otherwise races it."""

        def acked() -> bool:
            return any(
                c.types.get(response.type_url) is not None
                and c.types[response.type_url].version_acked == response.version_info
                for c in self.status.find(node_id)
            )

        await poll(acked, DEFAULT_TIMEOUT, f"{node_id} ACK of {response.type_url}")

    def sotw(self, node_id: str, cluster: str = "default", **kw: Any) -> SotwStream:
        stream = SotwStream(self.target, node_id, cluster, **kw)
        stream.server = self
        return stream

    def delta(self, node_id: str, cluster: str = "default", **kw: Any) -> DeltaStream:
        stream = DeltaStream(self.target, node_id, cluster, **kw)
        stream.server = self
        return stream


async def recv_well_formed(
    s: SotwStream, type_url: str | None = None, *, within: float = 5.0
) -> Any:
    """The next response (of `type_url`, when given), checked to be well formed."""
    return assert_well_formed(await (s.recv_type(type_url, within) if type_url else s.recv(within)))


async def join_like_envoy(s: SotwStream, eds: list[str], rds: list[str]) -> dict[str, Any]:
    """Subscribe like Envoy does at start: CDS, then EDS for its clusters, LDS, RDS; ACK each."""
    from xdsserver.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE

    got = {}
    for type_url, names in ((CLUSTER, []), (ENDPOINT, eds), (LISTENER, []), (ROUTE, rds)):
        await s.send(type_url, names)
        got[type_url] = response = await recv_well_formed(s)
        assert response.type_url == type_url
        await s.ack(response, names)
    return got
