"""ADS over mutual TLS: an Envoy's fleet comes from its certificate, never from its node claim.

One kvpilot serves ADS with a server certificate and a client CA, and binds the SPIFFE ID
``spiffe://kvpilot.test/fleet/a`` to fleet ``fleet-a``. Real Envoys connect with certificates
from SDS files; a rotated certificate file keeps the stream working.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography import x509
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from harness.auth import ADMIN
from harness.builders import fleet_policies, policy, pool, route
from harness.envoy import active_listeners
from harness.rig import api_client, apply
from harness.wait import wait_until

from controlplane.etcd import EtcdClient
from controlplane.local import EmbeddedEnvoy, EmbeddedEtcd, KvpilotProcess, free_port
from controlplane.local.pki import Ca, CertDir
from controlplane.rollouts.signals import SIGNALS_PREFIX
from xdsserver.identity import TlsFiles
from xdsserver.resources import LISTENER

pytestmark = pytest.mark.e2e

FLEET_A_ID = "spiffe://kvpilot.test/fleet/a"


def xds_client_serials(envoy: EmbeddedEnvoy) -> set[int]:
    """Serial numbers of the client certificates Envoy has loaded (admin /certs)."""
    certs = httpx.get(f"{envoy.admin_url}/certs", timeout=5).json()["certificates"]
    return {
        int(chain["serial_number"], 16)
        for entry in certs
        for chain in entry.get("cert_chain", [])
        if chain.get("serial_number")
    }


@pytest.fixture
def mtls(
    tmp_path_factory: pytest.TempPathFactory, etcd_prefix: str, kvpilot_factory: Any
) -> Iterator[dict[str, Any]]:
    ca = Ca()
    root = tmp_path_factory.mktemp("xds-pki")
    server = CertDir(
        root / "server", ca.issue("kvpilot", dns=("kvpilot",), ips=("127.0.0.1",)), ca.cert
    )
    kvpilot: KvpilotProcess = kvpilot_factory(
        etcd_prefix,
        xds_tls=TlsFiles(server.cert, server.key, server.ca),
        xds_identity_fleets=[f"{FLEET_A_ID}=fleet-a"],
    )
    api = api_client(kvpilot)
    ports = {"fleet-a": free_port(), "fleet-b": free_port()}
    apply(api, *fleet_policies(ports))
    # Until a fleet's policy is compiled its Envoys are served the default fleet's (empty)
    # config; the tests below are about identities, so they start once both fleets are built.
    for fleet in ports:
        wait_until(
            lambda fleet=fleet: (
                api.get(f"/v1/fleets/{fleet}/config").json().get("servedFrom") == fleet
            ),
            30,
            message=f"{fleet}'s policy to be compiled",
        )
    yield {
        "ca": ca,
        "root": root,
        "server": server,
        "kvpilot": kvpilot,
        "api": api,
        "ports": ports,
    }


def test_fleet_comes_from_the_certificate_and_a_rotated_certificate_keeps_working(
    mtls: dict[str, Any], envoy_factory: Any
) -> None:
    ca, root, kvpilot, api, ports = (mtls[k] for k in ("ca", "root", "kvpilot", "api", "ports"))
    first = ca.issue("envoy-a", uris=(FLEET_A_ID,))
    certs_a = CertDir(root / "envoy-a", first, ca.cert)
    envoy_a = envoy_factory(xds_port=kvpilot.xds_port, fleet="fleet-a", xds_tls_dir=certs_a.path)
    wait_until(
        lambda: active_listeners(envoy_a) == {f"listener-{ports['fleet-a']}"},
        30,
        message="the Envoy with fleet A's certificate to get fleet A's listener",
    )

    # The same identity claiming fleet B is refused: it gets nothing, and status says why.
    certs_b = CertDir(root / "envoy-b", ca.issue("envoy-a", uris=(FLEET_A_ID,)), ca.cert)
    claims_b = envoy_factory(xds_port=kvpilot.xds_port, fleet="fleet-b", xds_tls_dir=certs_b.path)

    def refused() -> dict[str, Any] | None:
        status = api.get("/v1/status").json()
        found = [r for r in status["refusedEnvoys"] if r["node_id"] == claims_b.node_id]
        return found[0] if found else None

    # An Envoy without a certificate (plaintext xDS cluster) does not get past the handshake.
    no_cert = envoy_factory(xds_port=kvpilot.xds_port, fleet="fleet-a")
    refusal = wait_until(refused, 30, message="the fleet-B claim to show as refused")
    wait_until(
        lambda: int(no_cert.stats().get("cluster.kvpilot_xds.upstream_cx_total", 0)) >= 2,
        30,
        message="the Envoy without a certificate to have tried (and retried) to connect",
    )
    assert no_cert.stats()["control_plane.connected_state"] == 0
    assert active_listeners(no_cert) == set()
    assert refusal["reason"] == "fleet_mismatch"
    assert refusal["identity"] == FLEET_A_ID
    assert "fleet-b" in refusal["message"] and FLEET_A_ID in refusal["message"]
    metrics = api.get("/metrics").text
    assert re.search(r'kvpilot_xds_refused_total\{reason="fleet_mismatch"\} [1-9]', metrics)
    assert active_listeners(claims_b) == set()
    status = api.get("/v1/status").json()
    connected = {e["node_id"]: e for e in status["envoys"]}
    assert claims_b.node_id not in connected and no_cert.node_id not in connected
    assert connected[envoy_a.node_id]["identity"] == FLEET_A_ID

    # A rotated certificate (new files swapped in) is loaded, and the stream keeps working:
    # a new listener for fleet A still arrives.
    second = ca.issue("envoy-a", uris=(FLEET_A_ID,))
    certs_a.write(second, ca.cert)
    wait_until(
        lambda: second.serial in xds_client_serials(envoy_a),
        30,
        message="Envoy to load the rotated client certificate",
    )
    extra = free_port()
    apply(api, policy("fleet-a-extra", extra, [route("p", name="r")], fleets=["fleet-a"]))
    wait_until(
        lambda: active_listeners(envoy_a) == {f"listener-{ports['fleet-a']}", f"listener-{extra}"},
        30,
        message="fleet A's new listener to reach the Envoy after its certificate rotated",
    )
    assert active_listeners(claims_b) == set()


def server_serial(port: int, ca: Path, client: CertDir) -> int:
    """The serial of the certificate kvpilot's ADS port presents in a new handshake."""
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(client.cert), str(client.key))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        context.wrap_socket(sock, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


def test_a_client_without_a_certificate_cannot_connect_and_the_server_cert_rotates(
    mtls: dict[str, Any],
) -> None:
    kvpilot, ca = mtls["kvpilot"], mtls["ca"]

    def discover(credentials: grpc.ChannelCredentials) -> Any:
        target = f"127.0.0.1:{kvpilot.xds_port}"
        options = [("grpc.ssl_target_name_override", "kvpilot")]
        with grpc.secure_channel(target, credentials, options=options) as channel:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            request = discovery_pb2.DiscoveryRequest(
                node=base_pb2.Node(id="no-cert", cluster="fleet-a"), type_url=LISTENER
            )
            return next(iter(stub.StreamAggregatedResources(iter([request]), timeout=10)))

    with pytest.raises(grpc.RpcError) as caught:
        discover(grpc.ssl_channel_credentials(root_certificates=ca.cert))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate from another CA is no better.
    stranger = Ca("someone else").issue("envoy-a", uris=(FLEET_A_ID,))
    with pytest.raises(grpc.RpcError) as caught:
        discover(
            grpc.ssl_channel_credentials(
                root_certificates=ca.cert, private_key=stranger.key, certificate_chain=stranger.cert
            )
        )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # With a good certificate the same request is answered: the failures above were the
    # missing or foreign certificate, not the test's client.
    good = ca.issue("envoy-a", uris=(FLEET_A_ID,))
    response = discover(
        grpc.ssl_channel_credentials(
            root_certificates=ca.cert, private_key=good.key, certificate_chain=good.cert
        )
    )
    assert response.type_url == LISTENER and len(response.resources) == 1
    connected = httpx.get(f"{kvpilot.api_url}/v1/status", headers=ADMIN).json()
    assert "no-cert" not in {r["node_id"] for r in connected["refusedEnvoys"]}
    # The handshake refused them, so no refusal reason claims to count them.
    metrics = httpx.get(f"{kvpilot.api_url}/metrics").text
    assert 'kvpilot_xds_refused_total{reason="unbound_identity"} 0.0' in metrics
    assert "no_certificate" not in metrics

    # kvpilot's own certificate rotates too: the next handshake presents the new one.
    client = CertDir(mtls["root"] / "probe", good, ca.cert)
    server: CertDir = mtls["server"]
    renewed = ca.issue("kvpilot", dns=("kvpilot",), ips=("127.0.0.1",))
    assert server_serial(kvpilot.xds_port, server.ca, client) != renewed.serial
    server.write(renewed, ca.cert)
    wait_until(
        lambda: server_serial(kvpilot.xds_port, server.ca, client) == renewed.serial,
        10,
        message="kvpilot to present its renewed ADS certificate",
    )


def test_serve_refuses_to_start_without_tls_or_the_plaintext_flag(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "commands.cli", "serve", "--etcd-endpoints", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode != 0
    assert "--xds-insecure-plaintext" in result.stderr and "--xds-cert" in result.stderr


def signal_records(etcd: EmbeddedEtcd, prefix: str) -> dict[str, dict[str, Any]]:
    """Every replica's published rollout-signal records in etcd, by key."""

    async def read() -> dict[str, dict[str, Any]]:
        async with EtcdClient([etcd.endpoint]) as client:
            kvs, _ = await client.get_prefix(f"{prefix}/{SIGNALS_PREFIX}".encode())
        return {kv.key.decode(): json.loads(kv.value) for kv in kvs}

    return asyncio.run(read())


def access_log(fleet: str, errors: int, cluster: str, port: int) -> Any:
    """A first access-log message naming a node of `fleet`, with `errors` upstream 503s on a
    host of `cluster` (what a forged stream would send to abort a canary)."""
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.node.id = f"signals-{fleet}"
    message.identifier.node.cluster = fleet
    message.identifier.log_name = "kvpilot_signals"
    for _ in range(errors):
        entry = message.http_logs.log_entry.add()
        common = entry.common_properties
        common.upstream_cluster = cluster
        common.upstream_remote_address.socket_address.address = "127.0.0.1"
        common.upstream_remote_address.socket_address.port_value = port
        entry.response.response_code.value = 503
    return message


def test_signal_streams_are_taken_only_from_a_certificate_bound_to_their_fleet(
    mtls: dict[str, Any], etcd: EmbeddedEtcd, etcd_prefix: str
) -> None:
    ca, kvpilot, api = mtls["ca"], mtls["kvpilot"], mtls["api"]
    # A host in both fleets' pool, so a counted entry resolves to it and gets published.
    host = free_port()

    def endpoints_version() -> str:
        return str(api.get("/v1/fleets/fleet-a/config").json()["versions"]["endpoints"])

    before = endpoints_version()
    apply(api, pool("p", [host]))
    wait_until(lambda: endpoints_version() != before, 30, message="the pool's host to be compiled")

    def send(identity: tuple[str, ...], fleet: str) -> Any:
        cert = ca.issue("signals-client", uris=identity)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.cert, private_key=cert.key, certificate_chain=cert.cert
        )
        options = [("grpc.ssl_target_name_override", "kvpilot")]
        target = f"127.0.0.1:{kvpilot.xds_port}"
        with grpc.secure_channel(target, credentials, options=options) as channel:
            stub = als_pb2_grpc.AccessLogServiceStub(channel)
            message = access_log(fleet, 20, f"{fleet}/r", host)
            return stub.StreamAccessLogs(iter([message]), timeout=10)

    # An unbound certificate, and one bound to fleet A, each report 20 503s for fleet B.
    for identity, reason in (
        (("spiffe://kvpilot.test/fleet/nobody",), "unbound_identity"),
        ((FLEET_A_ID,), "fleet_mismatch"),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            send(identity, "fleet-b")
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, reason
        assert identity[0] in (caught.value.details() or ""), reason
    refused = [
        r for r in api.get("/v1/status").json()["refusedEnvoys"] if r["service"] == "signals"
    ]
    assert {(r["fleet"], r["reason"]) for r in refused} == {
        ("fleet-b", "unbound_identity"),
        ("fleet-b", "fleet_mismatch"),
    }
    metrics = api.get("/metrics").text
    for reason in ("unbound_identity", "fleet_mismatch"):
        assert f'kvpilot_signals_refused_total{{reason="{reason}"}} 1.0' in metrics

    # The certificate bound to fleet A reporting for fleet A is taken, and published.
    send((FLEET_A_ID,), "fleet-a")
    records = wait_until(
        lambda: signal_records(etcd, etcd_prefix),
        30,
        message="the accepted stream's counts to be published to etcd",
    )
    # Nothing the refused streams sent was counted: the only record is fleet A's 20.
    [record] = records.values()
    assert record["cluster"] == "fleet-a/r"
    assert set(record["fleets"]) == {"fleet-a"}
    assert record["pools"]["p"]["requests"] == record["pools"]["p"]["errors"] == 20, record
