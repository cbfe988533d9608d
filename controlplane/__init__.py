"""The daemon's edges: etcd, reconcile, the telemetry agent and local processes.

- ``etcd``: a typed asyncio etcd v3 client; ``store``: the key layout, the object store and
  the watched ``StateMirror``;
- ``reconcile``: etcd state -> compile -> translate -> snapshots, debounced, with the EDS
  fast path;
- ``agent``: ``kvpilot agent`` (telemetry and registration);
- ``envoystatus``: each replica's Envoy connections, published to etcd;
- ``launchers``: local etcd, Envoy and kvpilot processes;
- ``asgi``: uvicorn servers that leave signal handling to their process.
"""
