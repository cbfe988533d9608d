"""The top of kvpilot: the commands a user runs.

- ``cli``: the ``kvpilot`` command (edit policy through the REST API, translate files
  offline, and the ``serve`` and ``agent`` verbs);
- ``serve``: ``kvpilot serve``, the daemon's composition root (etcd, reconcile, ADS, REST API);
- ``agent``: ``kvpilot agent``, the telemetry agent's command line (the agent itself is
  ``controlplane.agent``);
- ``demo``: ``make demo``, the whole control path on one machine.

Nothing below this package imports it.
"""
