"""Certificate identity to fleets: which claims an Envoy's certificate allows, and why not."""

from __future__ import annotations

import pytest

from xdsserver.identity import FleetBinding, PeerIdentity

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
        (None, "edge", "no_certificate"),
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
