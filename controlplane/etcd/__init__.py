"""A thin, typed asyncio client for the etcd v3 API (``client``, its watch in ``watch``), the
channels and retry policy beneath every call (``connection``), the values and errors it deals
in (``types``, whose every name the package exports too), leases kept alive in the background
(``lease``), and how it proves who it is to etcd (``security``).

Above the client: kvpilot's key layout and value encoding (``keys``), the store every etcd
access of kvpilot goes through (``store``) and the etcd flags every command shares
(``settings``). They import this package, so it does not re-export them."""

from controlplane.etcd import types
from controlplane.etcd.client import EtcdClient
from controlplane.etcd.lease import LeaseKeeper
from controlplane.etcd.security import EtcdSecurity
from controlplane.etcd.types import *  # noqa: F403

__all__ = ["EtcdClient", "EtcdSecurity", "LeaseKeeper"]
__all__ += types.__all__
