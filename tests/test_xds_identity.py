"""Certificate identity to fleets: which claims an Envoy's certificate allows, and why not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.discovery.v3 import discovery_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from xdsserver.identity import FleetBinding, PeerIdentity
from xdsserver.resources import LISTENER
from xdsserver.server import AdsServer
from xdsserver.signals import AccessLogServer, SignalBook
from xdsserver.snapshot import SnapshotCache
from xdsserver.status import ConnectionRegistry

EDGE = "spiffe://example.org/fleet/edge"
BINDING = FleetBinding.parse([f"{EDGE}=edge", f"{EDGE}=edge-canary", "gw.example.org=*"])


@pytest.mark.parametrize(
    ("identity", "fleet", "reason"),
    [
        (PeerIdentity(uris=(EDGE,)), "edge", None),
        (PeerIdentity(uris=(EDGE,)), "edge-canary", None),
        (PeerIdentity(uris=(EDGE,)), "payments", "fleet_mismatch"),
        (PeerIdentity(dns=("gw.example.org",)), "payments", None),
        (PeerIdentity(uris=("spiffe://example.org/other",)), "edge", "unbound_identity"),
        # The subject CN is not a binding name: only SANs are.
        (PeerIdentity(common_name=EDGE), "edge", "unbound_identity"),
        # Unreachable behind the handshake, which requires a certificate; bound to nothing.
        (None, "edge", "unbound_identity"),
    ],
)
def test_a_claim_is_allowed_only_by_a_bound_san(
    identity: PeerIdentity | None, fleet: str, reason: str | None
) -> None:
    refusal = BINDING.refusal(identity, fleet)
    assert (refusal[0] if refusal else None) == reason
    if refusal is not None and identity is not None:
        assert fleet in refusal[1] or "bound to no fleet" in refusal[1]


def test_identity_is_read_from_the_grpc_auth_context() -> None:
    context = {
        "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----..."],
        "x509_common_name": [b"envoy-7"],
        "peer_uri": [EDGE.encode()],
        "peer_dns": [b"envoy-7.example.org"],
    }
    identity = PeerIdentity.from_auth_context(context)
    assert identity == PeerIdentity(
        uris=(EDGE,), dns=("envoy-7.example.org",), common_name="envoy-7"
    )
    assert identity.describe() == EDGE
    assert PeerIdentity.from_auth_context({"transport_security_type": [b"ssl"]}) is None


@pytest.mark.parametrize("value", ["edge", "=edge", f"{EDGE}="])
def test_a_malformed_binding_says_how_to_write_one(value: str) -> None:
    with pytest.raises(ValueError, match="IDENTITY=FLEET"):
        FleetBinding.parse([value])


# -- one rule for both services on the gRPC port ---------------------------------------------

NAMES = ("spiffe://t/fleet/a", "spiffe://t/fleet/b", "gw.t", "other.t")
FLEETS = ("a", "b", "default")


class Aborted(Exception):
    """What `context.abort` raises (grpc.aio raises to end the handler)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PeerContext:
    """The parts of a grpc.aio servicer context the two services read: the authenticated
    peer's certificate names (as gRPC's auth context gives them) and abort. A real TLS
    handshake is in tests/test_e2e_xds_mtls.py; here the rule is exercised over many
    identities."""

    def __init__(self, uris: tuple[str, ...], dns: tuple[str, ...]) -> None:
        self._auth = {
            "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----"],
            "peer_uri": [u.encode() for u in uris],
            "peer_dns": [d.encode() for d in dns],
        }

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


async def _items(*items: Any) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def ads_verdict(binding: FleetBinding, context: PeerContext, fleet: str) -> bool:
    """Whether ADS takes a stream whose node claims `fleet` (False: PERMISSION_DENIED)."""
    server = AdsServer(SnapshotCache(), ConnectionRegistry(registry=CollectorRegistry()))
    server.binding = binding
    request = discovery_pb2.DiscoveryRequest(
        node=base_pb2.Node(id="n", cluster=fleet), type_url=LISTENER
    )
    try:
        async for _ in server._serve(_items(request), context, "sotw"):  # type: ignore[arg-type]
            pass
    except Aborted as aborted:
        assert aborted.code == grpc.StatusCode.PERMISSION_DENIED
        assert server.status.refusals()[0].service == "ads"
        return False
    return True


async def signals_verdict(binding: FleetBinding, context: PeerContext, fleet: str) -> bool:
    """Whether the signal service takes a stream reporting for `fleet`; a refused one must
    have counted nothing."""
    book = SignalBook(lambda cluster, address, port: "p")
    status = ConnectionRegistry(registry=CollectorRegistry())
    server = AccessLogServer(book, SnapshotCache(), binding=binding, status=status)
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.node.id = "n"
    message.identifier.node.cluster = fleet
    entry = message.http_logs.log_entry.add()
    entry.common_properties.upstream_cluster = "web/all"
    entry.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
    entry.common_properties.upstream_remote_address.socket_address.port_value = 9
    entry.response.response_code.value = 503
    try:
        await server.StreamAccessLogs(_items(message), context)  # type: ignore[arg-type]
    except Aborted as aborted:
        assert aborted.code == grpc.StatusCode.PERMISSION_DENIED
        assert book.counters == {} and book.changed == set()
        assert status.refusals()[0].service == "signals"
        return False
    assert book.counters["web/all"]["p"].as_json()
    return True


@settings(max_examples=150, deadline=None)
@given(
    bindings=st.dictionaries(
        st.sampled_from(NAMES), st.sets(st.sampled_from((*FLEETS, "*")), min_size=1)
    ),
    uris=st.lists(st.sampled_from(NAMES[:2]), max_size=2, unique=True),
    dns=st.lists(st.sampled_from(NAMES[2:]), max_size=2, unique=True),
    fleet=st.sampled_from(FLEETS),
)
def test_ads_and_the_signal_service_take_a_stream_only_from_a_certificate_bound_to_its_fleet(
    bindings: dict[str, set[str]], uris: list[str], dns: list[str], fleet: str
) -> None:
    binding = FleetBinding(bindings)
    context = PeerContext(tuple(uris), tuple(dns))
    bound = set().union(*(bindings.get(name, set()) for name in (*uris, *dns)))
    allowed = fleet in bound or "*" in bound

    async def both() -> tuple[bool, bool]:
        return await ads_verdict(binding, context, fleet), await signals_verdict(
            binding, context, fleet
        )

    assert asyncio.run(both()) == (allowed, allowed)
