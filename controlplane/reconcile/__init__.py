"""Decoded etcd state -> compile -> snapshots: the reconcile ``loop``, the ``live``
decisions it carries between compiles, its Prometheus ``metrics`` and the recent telemetry
``history`` the console reads."""

from controlplane.reconcile.loop import Reconciler

__all__ = ["Reconciler"]
