"""The routing benchmark: which routing policy wins, on the same workloads through one real
Envoy (the scenario suite, and the sequential replay with plots)."""
