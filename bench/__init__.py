"""Simulated model replicas, workloads and the benchmarks behind ``make bench``."""
