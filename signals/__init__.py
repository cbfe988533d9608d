"""The signal engine (no I/O): backend telemetry parsed into records, and what the live numbers
decide, each from plain data.

- ``telemetry``: model servers' Prometheus metrics -> ``TelemetryRecord`` (metric maps for
  vLLM, SGLang, TGI);
- ``weights``: per-endpoint weights from telemetry; ``admission``: per-class admission
  entries; ``saturation``: the saturated twin's fill; ``spill``: what a fleet's own
  locality keeps of its traffic;
- ``state``: ``PolicyState``, the objects, endpoints, telemetry and decisions the compiler
  reads; ``live``: the decisions a state's telemetry implies;
- ``spend``: token usage, prices and calendar windows (ledgers of spend by tenant, model,
  pool, class and route); ``budgets``: which budgets are spent; ``capacity``: what priced
  pools cost over a window.
"""

from signals.admission import AdmissionDecision
from signals.live import admission_decisions, saturation_decisions, telemetry_weights
from signals.saturation import SaturationDecision
from signals.spill import SpillDecision
from signals.state import PolicyState, is_external, pool_endpoints
from signals.telemetry import METRIC_MAPS, MetricMap, TelemetryRecord
from signals.weights import WeightDecision, WeightParams, pool_weights

__all__ = [
    "METRIC_MAPS",
    "AdmissionDecision",
    "MetricMap",
    "PolicyState",
    "SaturationDecision",
    "SpillDecision",
    "TelemetryRecord",
    "WeightDecision",
    "WeightParams",
    "admission_decisions",
    "is_external",
    "pool_endpoints",
    "pool_weights",
    "saturation_decisions",
    "telemetry_weights",
]
