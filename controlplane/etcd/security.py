"""How kvpilot proves who it is to etcd: TLS files, a client certificate, and etcd's
user/password authentication, whose auth token a gRPC interceptor adds to every call."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from controlplane.etcd.types import EtcdAccessDenied


@dataclass(frozen=True)
class EtcdSecurity:
    """How to prove who we are to etcd: TLS files and/or a user and password.

    The password never appears in ``repr`` or in an error message.
    """

    ca: Path | None = None
    """CA bundle that signs etcd's server certificate (``--etcd-cacert``)."""
    cert: Path | None = None
    """Client certificate for etcd's ``--client-cert-auth`` (``--etcd-cert``)."""
    key: Path | None = None
    """Private key of ``cert`` (``--etcd-key``)."""
    user: str | None = None
    """etcd user (``--etcd-user``); its password comes from the environment or a file."""
    password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the files; a file that cannot be read is a clear error."""

        def read(path: Path | None, what: str) -> bytes | None:
            if path is None:
                return None
            try:
                data = path.read_bytes()
            except OSError as error:
                raise EtcdAccessDenied(
                    f"cannot read the etcd {what} {path}: {error.strerror}"
                ) from None
            if b"-----BEGIN" not in data:
                raise EtcdAccessDenied(f"the etcd {what} {path} is not PEM")
            return data

        if (self.cert is None) != (self.key is None):
            raise EtcdAccessDenied("--etcd-cert and --etcd-key go together: give both or neither")
        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca, "CA (--etcd-cacert)"),
            private_key=read(self.key, "client key (--etcd-key)"),
            certificate_chain=read(self.cert, "client certificate (--etcd-cert)"),
        )

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The etcd security flags `kvpilot serve` and `kvpilot agent` share, each with an
        environment variable."""
        env = os.environ.get
        parser.add_argument(
            "--etcd-cacert",
            default=env("KVPILOT_ETCD_CACERT"),
            help="CA bundle of etcd's server certificate; turns on TLS (env KVPILOT_ETCD_CACERT)",
        )
        parser.add_argument(
            "--etcd-cert",
            default=env("KVPILOT_ETCD_CERT"),
            help="client certificate for etcd (env KVPILOT_ETCD_CERT)",
        )
        parser.add_argument(
            "--etcd-key",
            default=env("KVPILOT_ETCD_KEY"),
            help="private key of --etcd-cert (env KVPILOT_ETCD_KEY)",
        )
        parser.add_argument(
            "--etcd-user",
            default=env("KVPILOT_ETCD_USER"),
            help="etcd user; its password comes from KVPILOT_ETCD_PASSWORD or "
            "--etcd-password-file, never from a flag (env KVPILOT_ETCD_USER)",
        )
        parser.add_argument(
            "--etcd-password-file",
            default=env("KVPILOT_ETCD_PASSWORD_FILE"),
            help="file holding the etcd user's password (env KVPILOT_ETCD_PASSWORD_FILE)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str]) -> EtcdSecurity:
        """Read the flags (and the password) into an EtcdSecurity; SystemExit with a sentence
        on a combination that cannot work."""
        password = env.get("KVPILOT_ETCD_PASSWORD") or None
        if args.etcd_password_file:
            try:
                password = Path(args.etcd_password_file).read_text().rstrip("\r\n")
            except OSError as error:
                raise SystemExit(
                    f"cannot read the etcd password file {args.etcd_password_file}: "
                    f"{error.strerror}"
                ) from None
        user = args.etcd_user or None
        if user is not None and ":" in user:
            raise SystemExit(
                "--etcd-user takes the user name only; pass the password through "
                "KVPILOT_ETCD_PASSWORD or --etcd-password-file so it stays out of process lists"
            )
        if user is not None and not password:
            raise SystemExit(
                f"etcd user {user!r} needs a password: set KVPILOT_ETCD_PASSWORD or pass "
                "--etcd-password-file"
            )
        if bool(args.etcd_cert) != bool(args.etcd_key):
            raise SystemExit("--etcd-cert and --etcd-key go together: give both or neither")
        return cls(
            ca=Path(args.etcd_cacert) if args.etcd_cacert else None,
            cert=Path(args.etcd_cert) if args.etcd_cert else None,
            key=Path(args.etcd_key) if args.etcd_key else None,
            user=user,
            password=password if user is not None else None,
        )


_INTERCEPTORS = (
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
)


class AuthToken(*_INTERCEPTORS):  # type: ignore[misc]  # grpc ships no type information
    """Adds etcd's auth token (``token`` metadata) to every call on a channel."""

    def __init__(self) -> None:
        self.value: str | None = None

    def _details(self, details: Any) -> Any:
        if self.value is None:
            return details
        metadata = [*(details.metadata or ()), ("token", self.value)]
        return details._replace(metadata=grpc.aio.Metadata(*metadata))

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(details), request_iterator)


def is_bad_token(err: grpc.aio.AioRpcError) -> bool:
    """etcd's answer to an expired or unknown auth token (renew it and retry)."""
    details = err.details() or ""
    return "invalid auth token" in details or "auth token is expired" in details


def access_problem(err: grpc.aio.AioRpcError) -> str | None:
    """What an error says about our credentials, or None if it is not about them."""
    details = err.details() or ""
    lowered = details.lower()
    if err.code() == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in lowered:
        return "etcd denied the operation to this user (check its role's key permissions)"
    if "authentication failed" in lowered:
        return "etcd rejected the user name or password (check --etcd-user and the password)"
    if "user name is empty" in lowered or "user name not found" in lowered:
        return "etcd has authentication enabled: pass --etcd-user and the password"
    # "tcp handshaker shutdown" is gRPC giving up on a TCP connect (a busy or restarting
    # etcd): a connection to retry, not a credential problem, although it says "handshake".
    if any(
        word in lowered.replace("tcp handshaker", "")
        for word in ("handshake", "certificate", "ssl", "tls")
    ):
        return (
            "the TLS handshake with etcd failed (check --etcd-cacert, --etcd-cert and "
            "--etcd-key, and that the endpoints speak TLS)"
        )
    return None
