"""The daemon's edges: etcd, decode, reconcile, the telemetry agent and local processes.

- ``etcd``: a typed asyncio etcd v3 client; ``store``: the key layout and the store every etcd
  access goes through; ``mirror``: the daemon's watched view of everything under the prefix;
- ``decode``: etcd values -> policy objects, for the reconciler and the API's dry run alike;
- ``reconcile``: decoded state -> compile -> snapshots, debounced (the snapshot building
  itself is ``xdsserver.incremental``);
- ``agent``: ``kvpilot agent`` (telemetry and registration);
- ``envoystatus``: each replica's Envoy connections, published to etcd;
- ``launchers``: local etcd, Envoy and kvpilot processes, one module each;
- ``asgi``: uvicorn servers that leave signal handling to their process.
"""
