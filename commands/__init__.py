"""The top of kvpilot: the commands a user runs.

- ``cli``: the ``kvpilot`` command (edit policy through the REST API, translate files
  offline, and the ``serve`` and ``agent`` verbs);
- ``serve``: ``kvpilot serve``, the daemon's composition root (etcd, reconcile, ADS, REST API);
- ``agent``: ``kvpilot agent``, the telemetry agent's command line (the agent itself is
  ``controlplane.agent``);
- ``demo``: ``make demo``, the whole control path on one machine.

Nothing below this package imports it.
"""

import os

# gRPC's fork support runs its own handlers in a child forked while gRPC threads are busy.
# kvpilot forks only to exec etcd, Envoy or a replica (with a preexec_fn, so a real fork), and
# in that window the handlers can start a poller on descriptors the child is closing, which
# aborts the child before it execs (seen as Envoy "exiting" with SIGABRT at start, with an
# "epoll_wait error: Bad file descriptor" in its log). A child that execs needs none of it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
