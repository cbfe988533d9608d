"""The kvpilot daemon and its tools.

- ``etcd``: a typed asyncio etcd v3 client; ``store``: the key layout, the object store and
  the watched ``StateMirror``;
- ``reconcile``: etcd state -> compile -> translate -> snapshots, debounced, with the EDS
  fast path;
- ``serve``: ``kvpilot serve``; ``agent``: ``kvpilot agent`` (telemetry and registration);
- ``envoystatus``: each replica's Envoy connections, published to etcd;
- ``cli`` and ``client``: the ``kvpilot`` command and its REST client;
- ``launchers``: local etcd, Envoy and kvpilot processes; ``demo``: ``make demo``;
- ``asgi``: uvicorn servers that leave signal handling to their process.
"""
