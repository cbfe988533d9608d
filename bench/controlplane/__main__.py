"""``python -m bench.controlplane serve [kvpilot serve flags] --ack-log PATH``: the ACK-logging
daemon (`bench.controlplane.acklog.AckLogKvpilot` starts it). Every commit has this entry under
this name, so ``bench.controlplane.baseline`` starts an older commit's daemon the same way."""

import sys

from bench.controlplane.acklog import serve_with_ack_log

if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python -m bench.controlplane serve [kvpilot serve flags] --ack-log PATH")
    sys.exit(serve_with_ack_log(sys.argv[2:]))
