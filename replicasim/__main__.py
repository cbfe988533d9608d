"""``python -m replicasim``: simulated replicas in this process (see `replicasim.server`)."""

import sys

from replicasim.server import main

if __name__ == "__main__":
    sys.exit(main())
