"""The benchmarks behind ``make bench`` / ``python -m bench``, and the rig they share.

- `bench.rig`: the stack (etcd, kvpilot, Envoy, simulated replicas from `replicasim`), the
  workloads, the load generator, the routing policies' routes, the measurements, the
  command-line pieces every benchmark shares.
- one subpackage per benchmark (`bench.routing`, `bench.controlplane`, `bench.rollout`,
  `bench.classes`), each with its config, its run and its report, and an ``entry`` module
  whose `BENCHMARK` object implements `bench.benchmark.Benchmark`.
- `bench.registry`: the list ``python -m bench`` dispatches through.

Adding a benchmark (say ``cost``):

1. ``bench/cost/config.py``: a frozen dataclass with an ``out_dir`` field and a
   ``default_config(short: bool) -> CostConfig`` (``short`` is the smoke run's size);
   ``bench/cost/run.py``: ``run_cost(config, state_dir) -> Path`` on the rig
   (`bench.rig.stack.start_stack`, `bench.rig.loadgen.replay`), returning typed results to
   ``bench/cost/report.py``, which writes the Markdown report and the JSON file
   (`bench.rig.report` has the table and number helpers).
2. ``bench/cost/entry.py``: a class with ``name = "cost"``, ``summary`` (one line for
   ``--help``), ``add_arguments(parser)`` for its own flags and ``run(args) -> Written``,
   and ``BENCHMARK = CostBenchmark()``; import heavy modules inside ``run``.
3. One line in `bench.registry.BENCHMARKS`; a smoke test that runs
   ``python -m bench cost --short --out TMP`` (tests/test_bench_*_smoke.py); a section in
   docs/benchmarks.md. ``make bench`` runs only what the Makefile names.
"""
