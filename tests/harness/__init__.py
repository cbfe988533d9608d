"""The one test harness every test module uses (beside the fixtures in ``conftest.py``).

- ``builders``: pools, policies and routes, fleets, rollouts, chat request bodies;
- ``traffic``: requests through Envoy and which replica answered, background traffic,
  binomial bounds;
- ``envoy``: what a real Envoy holds (hosts, weights, health, active listeners);
- ``status``: what a running kvpilot reports (``/v1/status``, served versions, metrics);
- ``rig``: one ``kvpilot serve``, one Envoy and the REST API, and applying objects;
- ``api``: the REST API in process over a real etcd;
- ``xdsclient``: an ADS test client and server, and xDS message builders;
- ``regions``: two regions in one policy state (pool, policy, a fleet per region) for the
  spill tests;
- ``agent``, ``gated_backend``: model-server stand-ins the tests control;
- ``auth``, ``wait``, ``processes``: the test tokens, waiting with a deadline, finding
  processes and freezing etcd.

No test module imports another: a helper two modules need lives here.
"""
