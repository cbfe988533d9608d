"""What every benchmark runs on: the stack (etcd, kvpilot, Envoy, simulated replicas), the
workloads, the load generator, the routing policies' routes and the measurements."""
