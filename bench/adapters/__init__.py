"""Adapter-aware routing benchmarks: what it costs Envoy (``envoy_cost``) and what it saves
replicas in adapter loads and time to first token (``run``)."""
