"""A simulated vLLM-like model replica: OpenAI-compatible endpoints, a paged KV cache with
prefix caching, continuous batching in simulated time and vLLM's Prometheus metrics.

Used by the demo, the tests and the benchmarks; it imports no other package of this project,
so anything may start it (`python -m replicasim`; from Python,
`controlplane.local.replicas.BackendProcess`).
"""
