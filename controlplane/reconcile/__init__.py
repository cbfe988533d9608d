"""Decoded etcd state -> compile -> snapshots: the reconcile ``loop``, the ``live``
decisions it carries between compiles, its Prometheus ``metrics``, the recent telemetry
``history`` the console reads, the virtual models' shares (``difficulty``) and the budget
verdicts (``budgets``)."""

from controlplane.reconcile.loop import Reconciler

__all__ = ["Reconciler"]
