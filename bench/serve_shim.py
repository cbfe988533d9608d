"""`kvpilot serve` for the benchmark while `controlplane.cli` is not in the tree yet.

`KvpilotProcess` runs ``python -m controlplane.cli serve ...``; until that module lands, the
benchmark runs this instead, which parses the same flags with `controlplane.serve`'s own
`add_arguments` and calls its `run`. Delete it once `controlplane.cli` exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from controlplane.launchers import KvpilotProcess
from controlplane.serve import add_arguments, run


def cli_missing() -> bool:
    return importlib.util.find_spec("controlplane.cli") is None


class BenchKvpilotProcess(KvpilotProcess):
    """`KvpilotProcess` that falls back to this module when `controlplane.cli` is missing."""

    def _argv(self) -> list[str]:
        argv = super()._argv()
        if cli_missing():
            argv[argv.index("controlplane.cli")] = "bench.serve_shim"
        return argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_shim")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("serve"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
