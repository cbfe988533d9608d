"""The etcd settings `kvpilot serve` and `kvpilot agent` share: their flags (each with an
environment variable for containers), reading them, and opening a client with them that says
at once when etcd refuses who we are."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.etcd import EtcdAccessDenied, EtcdClient, EtcdSecurity, EtcdUnavailable
from controlplane.etcd.keys import DEFAULT_PREFIX

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EtcdSettings:
    """Where etcd is, under which key prefix kvpilot keeps its state, and how to prove who we
    are to it."""

    endpoints: list[str]
    prefix: str
    security: EtcdSecurity


def add_etcd_arguments(
    parser: argparse.ArgumentParser, *, default_endpoints: str, endpoints_help: str
) -> None:
    """`--etcd-endpoints` (comma-separated; `endpoints_help` says what its default means),
    `--etcd-prefix` and the TLS and user flags of `EtcdSecurity`."""
    env = os.environ.get
    parser.add_argument(
        "--etcd-endpoints",
        default=env("KVPILOT_ETCD_ENDPOINTS", default_endpoints),
        help=endpoints_help,
    )
    parser.add_argument(
        "--etcd-prefix",
        default=env("KVPILOT_ETCD_PREFIX", DEFAULT_PREFIX),
        help="etcd key prefix (env KVPILOT_ETCD_PREFIX)",
    )
    EtcdSecurity.add_arguments(parser)


def etcd_settings(args: argparse.Namespace, env: Mapping[str, str]) -> EtcdSettings:
    """The flags `add_etcd_arguments` added, read (the password from `env` or its file)."""
    return EtcdSettings(
        endpoints=[e.strip() for e in args.etcd_endpoints.split(",") if e.strip()],
        prefix=args.etcd_prefix,
        security=EtcdSecurity.from_args(args, env),
    )


async def open_client(
    endpoints: list[str], security: EtcdSecurity, *, meanwhile: str
) -> EtcdClient:
    """A connected client, once etcd has not refused its credentials.

    A certificate or password etcd refuses will not start working by waiting: this closes
    the client and raises `EtcdAccessDenied`, whose message says which setting to check. An
    etcd that is down may come up: this logs a warning ending in `meanwhile` (what the caller
    does until then) and returns the client, which keeps trying.
    """
    client = EtcdClient(endpoints, security=security)
    await client.connect()
    try:
        await client.check_access()
    except EtcdAccessDenied:
        await client.close()
        raise
    except EtcdUnavailable as error:
        log.warning("%s; %s", error, meanwhile)
    return client
