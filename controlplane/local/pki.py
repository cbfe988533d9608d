"""Throwaway certificate authorities and certificates, made at run time: the local stack's
mutual TLS (`make demo`, the benchmarks) and the tests use them; no key is ever committed.

`Ca.issue` gives a leaf certificate with the SANs a caller needs (SPIFFE URIs, DNS names,
127.0.0.1); `CertDir` lays certificate files out as a Kubernetes Secret volume does
(`tls.crt -> ..data/tls.crt`, `..data -> ..<version>`), so rotating swaps one symlink
atomically, which is what Envoy's `watched_directory` and kvpilot's file watch expect.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class Leaf:
    cert: bytes
    key: bytes
    serial: int


class Ca:
    """A self-signed CA that issues server and client certificates."""

    def __init__(self, name: str = "kvpilot test CA", *, days: int = 2) -> None:
        self._key = _key()
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        common_name: str,
        *,
        dns: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        days: int = 1,
    ) -> Leaf:
        """A certificate for both TLS server and client use, with the given SANs, valid for
        `days` (short by default: the tests and the demo make new ones every run)."""
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.UniformResourceIdentifier(u) for u in uris]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Leaf(
            cert.public_bytes(serialization.Encoding.PEM), _pem_key(key), cert.serial_number
        )


class CertDir:
    """`tls.crt`, `tls.key` and `ca.crt` in a directory laid out like a Kubernetes Secret."""

    def __init__(self, path: Path, leaf: Leaf, ca: bytes) -> None:
        self.path = path
        self._versions = itertools.count(1)
        path.mkdir(parents=True, exist_ok=True)
        self.write(leaf, ca)
        for name in ("tls.crt", "tls.key", "ca.crt"):
            (path / name).symlink_to(f"..data/{name}")

    @property
    def cert(self) -> Path:
        return self.path / "tls.crt"

    @property
    def key(self) -> Path:
        return self.path / "tls.key"

    @property
    def ca(self) -> Path:
        return self.path / "ca.crt"

    def write(self, leaf: Leaf, ca: bytes) -> None:
        """Put new files in place at once (a rotation): write a version, swap `..data`."""
        version = self.path / f"..v{next(self._versions)}"
        version.mkdir()
        (version / "tls.crt").write_bytes(leaf.cert)
        (version / "tls.key").write_bytes(leaf.key)
        (version / "ca.crt").write_bytes(ca)
        staging = self.path / "..data_tmp"
        staging.symlink_to(version.name)
        os.replace(staging, self.path / "..data")
