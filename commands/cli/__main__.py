"""``python -m commands.cli``: the ``kvpilot`` command."""

import sys

from commands.cli import main

sys.exit(main())
