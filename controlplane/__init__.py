"""The daemon's edges: etcd, decode, reconcile, rollouts, the telemetry agent and local
processes.

- ``etcd``: a typed asyncio etcd v3 client, the key layout (``etcd.keys``), the store every
  etcd access goes through (``etcd.store``) and the etcd flags and settings every command
  shares (``etcd.settings``); ``mirror``: the daemon's watched view of everything under the
  prefix;
- ``decode``: etcd values -> policy objects, for the reconciler and the API's dry run alike;
- ``reconcile``: decoded state -> compile -> snapshots, debounced (the snapshot building
  itself is ``xdsserver.incremental``), with the live decisions kept between compiles, the
  reconcile metrics and the recent telemetry history;
- ``rollouts``: the rollout controller, its records in etcd, its Prometheus queries and the
  data-plane signals every replica publishes for it; ``election``: which replica drives them;
- ``agent``: the telemetry agent behind ``kvpilot agent`` (telemetry and registration);
- ``spend``: token accounting shared through etcd (each replica's ledger in batches, the
  fleet's sum, the Prometheus counters); the budget verdicts it feeds are
  ``reconcile.budgets``;
- ``envoystatus``: each replica's Envoy connections, published to etcd; ``audit``: who
  changed what; ``rests``: paid pools resting after a 429, shared; ``prefillfits``:
  overflow's prefill fits, kept for the next run;
- ``local``: development only: local etcd, Envoy and kvpilot processes, one module each, and
  the throwaway CA (``local.pki``) of the local stack and the tests;
- ``asgi``: uvicorn servers that leave signal handling to their process.
"""
