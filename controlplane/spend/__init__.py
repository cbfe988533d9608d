"""Spend shared across kvpilot replicas through etcd, and kept across restarts.

Each replica folds the usage entries of its Envoys into a Ledger (``xdsserver.usage``) and
writes the tenants that changed, at most once per ``interval``, to
``{prefix}/status/spend/{replica}/{tenant}`` in one transaction: a batch, never a write per
request. The records carry no lease: a replica that stops leaves its counts behind, so no
spend is lost when it goes; a replica started again under the same ``--replica-id`` reads its
own records back first and continues from them. Readers sum every replica's records (totals,
or the current calendar window of a kind) from their etcd mirror, taking their own replica's
counters from memory, which are newer.

Modules: ``records`` (the etcd keys and the fleet's sum), ``publisher`` (this replica's
batches), ``context`` (entries resolved against the plan), ``metrics`` (Prometheus, virtual models' savings included).
"""

from controlplane.spend.context import PlanContext
from controlplane.spend.metrics import SavingsCollector, SpendCollector
from controlplane.spend.publisher import SpendPublisher
from controlplane.spend.records import (
    SPEND_INTERVAL,
    SPEND_PREFIX,
    fleet_spend,
    records,
    replica_of,
    spend_key,
)

__all__ = [
    "SPEND_INTERVAL",
    "SPEND_PREFIX",
    "PlanContext",
    "SavingsCollector",
    "SpendCollector",
    "SpendPublisher",
    "fleet_spend",
    "records",
    "replica_of",
    "spend_key",
]
