"""The regions benchmark: two regions of simulated replicas with an inter-region round trip,
one Envoy fleet per region, locality-blind against locality-aware routing through steady
load, a regional overload, a region down and a spot preemption wave (``docs/regions.md``).

``config`` (settings), ``stack`` (the rig), ``load`` (open-loop load per region), ``run``
(the phases), ``marks`` (when what happened), ``report`` (the numbers and the Markdown report).
"""
