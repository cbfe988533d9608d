"""Progressive rollouts: the leader's ``controller``, the status it keeps in etcd
(``state``), its Prometheus queries (``analysis``) and the data-plane ``signals`` every
replica publishes for it."""

from controlplane.rollouts.controller import RolloutController

__all__ = ["RolloutController"]
