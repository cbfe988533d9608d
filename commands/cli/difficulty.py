"""``kvpilot difficulty fit``: fit a virtual model's built-in scorer from labelled prompts and
write the weights into its policy file (offline: no server, no etcd)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from commands.cli.common import AddParser, CliError
from policies import PolicyError, parse_object
from signals.difficultyfit import LabelError, fit, read_rows


def _virtual_model(docs: list[Any], name: str, policy: str | None) -> dict[str, Any]:
    """The virtual model ``name`` among the documents (of ``policy`` when given)."""
    found = []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") != "RoutingPolicy":
            continue
        if policy is not None and (doc.get("metadata") or {}).get("name") != policy:
            continue
        for virtual in (doc.get("spec") or {}).get("virtualModels") or []:
            if isinstance(virtual, dict) and virtual.get("name") == name:
                found.append(virtual)
    if not found:
        raise CliError(f"no RoutingPolicy in the file declares virtual model {name!r}")
    if len(found) > 1:
        raise CliError(f"several policies declare virtual model {name!r}: name one with --policy")
    return found[0]


def cmd_fit(args: argparse.Namespace) -> int:
    try:
        with args.data.open() as lines:
            rows = read_rows(lines)
        result = fit(rows)
    except OSError as error:
        raise CliError(f"cannot read {args.data}: {error.strerror}") from None
    except LabelError as error:
        raise CliError(f"{args.data}: {error}") from None
    try:
        docs = list(yaml.safe_load_all(args.filename.read_text()))
    except (OSError, yaml.YAMLError) as error:
        raise CliError(f"cannot read {args.filename}: {error}") from None
    virtual = _virtual_model(docs, args.virtual_model, args.policy)
    scorer = virtual.setdefault("scorer", {})
    scorer["builtin"] = {"weights": result.weights, "bias": result.bias}
    try:
        for doc in docs:
            if doc is not None:
                parse_object(doc, source=str(args.filename))
    except PolicyError as error:
        raise CliError(str(error)) from None
    print(
        f"fitted {args.virtual_model} on {result.trained} rows; ROC AUC on "
        f"{result.held_out} held-out rows: {result.auc:.3f}",
        file=sys.stderr,
    )
    text = yaml.safe_dump_all([doc for doc in docs if doc is not None], sort_keys=False)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


def add_parsers(add_parser: AddParser) -> None:
    """`difficulty fit`."""
    difficulty = add_parser("difficulty", help="virtual models: fit the built-in scorer")
    commands = difficulty.add_subparsers(dest="difficulty_command", required=True)
    fit_parser = commands.add_parser(
        "fit",
        help="fit the built-in scorer's weights from labelled prompts (JSONL with small_ok "
        "and request or prompt) and write them into the policy",
    )
    fit_parser.add_argument("data", type=Path, help="labelled prompts, JSON Lines")
    fit_parser.add_argument(
        "-f", "--filename", type=Path, required=True, help="policy file that declares it"
    )
    fit_parser.add_argument("--virtual-model", required=True, help="the virtual model's name")
    fit_parser.add_argument("--policy", help="the RoutingPolicy, when several declare the name")
    fit_parser.add_argument(
        "-o", "--output", type=Path, help="write the policy here (default: standard output)"
    )
    fit_parser.set_defaults(func=cmd_fit)
