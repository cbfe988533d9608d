"""``kvpilot docs``: pages generated from the code, so they cannot drift from it.

``kvpilot docs policy-reference`` prints docs/policy-reference.md, every field of every
object from the models (the same text as the OpenAPI schema); ``-o FILE`` writes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commands.cli.common import AddParser
from policies.reference import policy_reference


def cmd_policy_reference(args: argparse.Namespace) -> int:
    text = policy_reference()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def add_parsers(add_parser: AddParser) -> None:
    """`docs policy-reference`."""
    docs = add_parser("docs", help="print documentation generated from the code")
    pages = docs.add_subparsers(dest="page", metavar="PAGE", required=True)
    reference = pages.add_parser(
        "policy-reference",
        help="every field of every object, from the models (docs/policy-reference.md)",
    )
    reference.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="write it to FILE instead of stdout"
    )
    reference.set_defaults(func=cmd_policy_reference)
