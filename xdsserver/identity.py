"""Who an Envoy is, from its client certificate, and which fleets that identity may receive.

An Envoy's node (``node.id``, ``node.cluster``) is whatever the Envoy says it is, so it cannot
decide what config the Envoy is sent: anyone who reaches the ADS port could claim any fleet and
read its routes, pool addresses and provider hosts. With mutual TLS the certificate the Envoy
presents, checked against the client CA, is the identity; ``FleetBinding`` maps its SANs
(a SPIFFE ID such as ``spiffe://example.org/fleet/edge`` or a DNS name) to the fleets it may
receive, and a node whose claim falls outside them is refused and gets nothing. Istio binds a
proxy's config to its certificate in the same way.

Certificates and keys are read from files on every TLS handshake that follows a change, so a
rotated server certificate or client CA takes effect without a restart.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

ANY_FLEET = "*"
"""As a binding's fleet: this identity may receive every fleet (a trusted gateway, tooling)."""


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """The names in an authenticated peer's certificate, as gRPC reports them."""

    uris: tuple[str, ...] = ()
    """URI SANs (SPIFFE IDs)."""
    dns: tuple[str, ...] = ()
    """DNS SANs."""
    common_name: str = ""

    @classmethod
    def from_auth_context(cls, context: Mapping[str, Iterable[bytes]]) -> PeerIdentity | None:
        """The identity in a gRPC auth context; None when the peer presented no certificate."""
        if not context.get("x509_pem_cert") and not context.get("x509_common_name"):
            return None

        def values(name: str) -> tuple[str, ...]:
            return tuple(v.decode(errors="replace") for v in context.get(name, ()))

        return cls(
            uris=values("peer_uri") or values("peer_spiffe_id"),
            dns=values("peer_dns"),
            common_name=next(iter(values("x509_common_name")), ""),
        )

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a binding can match, SANs first (URIs, then DNS names)."""
        return (*self.uris, *self.dns)

    def describe(self) -> str:
        """One name for logs and status: the first SAN, else the subject CN."""
        return next(iter(self.names), "") or (f"CN={self.common_name}" if self.common_name else "")


class FleetBinding:
    """Certificate identity (a SAN, exactly) -> the fleets an Envoy holding it may receive."""

    def __init__(self, bindings: Mapping[str, Iterable[str]]) -> None:
        self._fleets = {name: frozenset(fleets) for name, fleets in bindings.items()}

    @classmethod
    def parse(cls, values: Iterable[str]) -> FleetBinding:
        """``IDENTITY=FLEET`` pairs (repeatable per identity); ``FLEET`` may be ``*``."""
        bindings: dict[str, set[str]] = {}
        for value in values:
            identity, sep, fleet = value.rpartition("=")
            if not sep or not identity or not fleet:
                raise ValueError(
                    f"an xDS identity binding takes IDENTITY=FLEET (for example "
                    f"spiffe://example.org/fleet/edge=edge), not {value!r}"
                )
            bindings.setdefault(identity, set()).add(fleet)
        return cls(bindings)

    def __bool__(self) -> bool:
        return bool(self._fleets)

    def fleets(self, identity: PeerIdentity) -> frozenset[str]:
        """Every fleet any of the identity's SANs is bound to (``*`` stands for all)."""
        out: set[str] = set()
        for name in identity.names:
            out |= self._fleets.get(name, frozenset())
        return frozenset(out)

    def refusal(self, identity: PeerIdentity | None, fleet: str) -> tuple[str, str] | None:
        """Why an Envoy with ``identity`` may not receive ``fleet``: (reason, sentence), or
        None when it may. The sentence names the identity and the fleet, never a secret.

        ``identity`` None (a peer without a certificate) cannot reach this while the TLS
        handshake requires a client certificate; it is bound to no fleet all the same.
        """
        if identity is None:
            return (
                "unbound_identity",
                "the peer presented no client certificate, so it is bound to no fleet; give it "
                "one signed by the xDS client CA",
            )
        allowed = self.fleets(identity)
        who = identity.describe() or "a certificate without SANs"
        if not allowed:
            return (
                "unbound_identity",
                f"certificate identity {who!r} is bound to no fleet; bind it with "
                f"--xds-identity-fleet '{who}=FLEET'",
            )
        if ANY_FLEET in allowed or fleet in allowed:
            return None
        return (
            "fleet_mismatch",
            f"node claims fleet {fleet!r} but certificate identity {who!r} may receive only "
            f"{', '.join(sorted(allowed))}; fix the Envoy's --service-cluster (node.cluster) or "
            "the identity binding",
        )


REFUSAL_REASONS = ("unbound_identity", "fleet_mismatch")
"""Every reason ``FleetBinding.refusal`` gives. A client without a certificate signed by the
client CA never gets this far: the TLS handshake refuses it, before any service runs."""


@dataclass(frozen=True, slots=True)
class PeerCheck:
    """What the identity rule decided for one gRPC stream."""

    identity: str
    """The peer's identity for logs and status (its first SAN); "" without mutual TLS."""
    refusal: tuple[str, str] | None
    """(reason, sentence) when the stream must be refused; None when it may go on."""


def check_peer(
    binding: FleetBinding | None, auth_context: Mapping[str, Iterable[bytes]], fleet: str
) -> PeerCheck:
    """The one identity rule of kvpilot's gRPC port, for ADS and the access-log signal
    service alike: with mutual TLS (``binding`` given) a stream may act for ``fleet`` only
    if the client certificate is bound to that fleet or to ``*``. Without mutual TLS
    (plaintext, ``binding`` None) every stream is taken at its word.

    ADS applies it so a node cannot read another fleet's config; the signal service so a
    certificate cannot write another fleet's rollout signals (forged errors that abort, or
    clean numbers that push through, another fleet's canary).
    """
    if binding is None:
        return PeerCheck("", None)
    identity = PeerIdentity.from_auth_context(auth_context)
    described = identity.describe() if identity is not None else ""
    return PeerCheck(described, binding.refusal(identity, fleet))


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of a TLS server that asks clients for certificates."""

    cert: Path
    key: Path
    client_ca: Path

    def check(self) -> None:
        """Raise ValueError with a sentence naming the file that is missing or unreadable."""
        for what, path in (
            ("certificate", self.cert),
            ("key", self.key),
            ("client CA", self.client_ca),
        ):
            try:
                data = path.read_bytes()
            except OSError as error:
                raise ValueError(
                    f"cannot read the xDS TLS {what} {path}: {error.strerror}"
                ) from None
            if b"-----BEGIN" not in data:
                raise ValueError(f"the xDS TLS {what} {path} is not PEM")

    def _stamp(self) -> tuple[float, ...]:
        stamps: list[float] = []
        for path in (self.cert, self.key, self.client_ca):
            try:
                stamps.append(os.stat(path).st_mtime_ns)
            except OSError:
                stamps.append(-1)
        return tuple(stamps)

    def _configuration(self) -> Any:
        return grpc.ssl_server_certificate_configuration(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes(),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that require a client certificate signed by ``client_ca`` and pick up
        changed files at the next handshake (certificate rotation without a restart)."""
        self.check()
        state = {"stamp": self._stamp()}

        def fetch() -> Any:
            # Called by gRPC before each handshake; None keeps the current configuration.
            stamp = self._stamp()
            if stamp == state["stamp"]:
                return None
            try:
                configuration = self._configuration()
            except (OSError, ValueError) as error:
                log.warning("xDS TLS files changed but cannot be read (%s); keeping the old", error)
                return None
            state["stamp"] = stamp
            log.info("xDS TLS certificate files changed: new handshakes use them")
            return configuration

        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), fetch, require_client_authentication=True
        )
