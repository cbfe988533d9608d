"""No page contradicts `--help`: the flag tables in docs/ and the `kvpilot` commands shown in
README.md and docs/ are compared with the argparse parsers the commands run.

- The table of `kvpilot serve`'s flags (docs/operations.md) names every flag serve has and no
  other, with the environment variable and the default `--help` gives.
- Every `kvpilot COMMAND ... --flag` written in a code block or code span names a flag that
  COMMAND has; so does every `python -m bench [NAME] ... --flag` and `make bench
  BENCH_ARGS="[NAME] ..."` for the benchmark NAME (the default one without a name).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import parser as bench_parser
from bench.registry import DEFAULT as DEFAULT_BENCHMARK
from commands.cli import build_parser
from controlplane.etcd.keys import DEFAULT_PREFIX
from controlplane.local import repo_root

PAGES = [repo_root() / "README.md", *sorted((repo_root() / "docs").glob("*.md"))]
SERVE_TABLE = repo_root() / "docs" / "operations.md"
GLOBAL = {"--server", "--token", "--help", "-h", "--version"}
EFFECTIVE_DEFAULTS = {
    # The parser leaves it unset so the environment can say "not given"; etcd_settings
    # then takes the key layout's default.
    "--etcd-prefix": DEFAULT_PREFIX,
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """The flags of a command and of its own subcommands (`rollout pause`, `docs ...`)."""
    flags = {option for action in parser._actions for option in action.option_strings}
    for child in _subparsers(parser).values():
        flags |= _flags(child)
    return flags


COMMANDS = _subparsers(build_parser())
BENCHMARKS = _subparsers(bench_parser())


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def _env(action: argparse.Action) -> set[str]:
    return set(re.findall(r"env (KVPILOT_[A-Z_]+)", action.help or ""))


def _serve_rows() -> Iterator[tuple[list[str], list[str], str]]:
    """(flags, environment variables, default cell) of each row of serve's table."""
    text = SERVE_TABLE.read_text()
    table = text.split("| flag | environment | default | meaning |", 1)[1]
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        flag_cell, env_cell, default_cell, _ = (c.strip() for c in line[1:].split("|", 3))
        flags = [code.split()[0] for code in re.findall(r"`([^`]+)`", flag_cell)]
        envs = re.findall(r"`([^`]+)`", env_cell)
        yield flags, envs, default_cell


def _matches(cell: str, default: Any) -> bool:
    """A table's default, in words, against the parser's value."""
    cell = cell.strip()
    if default in (None, "", []):
        return cell.startswith("none")
    if default is False:
        return cell == "off"
    code = re.fullmatch(r"`([^`]*)`", cell)
    if code:
        return code.group(1) == str(default)
    number = re.match(r"[0-9.]+", cell)
    return number is not None and float(number.group()) == float(default)


def test_the_serve_table_has_every_flag_with_the_help_s_environment_and_default() -> None:
    actions = _actions(COMMANDS["serve"])
    documented: set[str] = set()
    for flags, envs, default_cell in _serve_rows():
        # One default for several flags (`none`), or one each (`0.02 s, 0.25 s`).
        defaults = (
            [d.strip() for d in default_cell.split(", ")] if len(flags) > 1 else [default_cell]
        )
        defaults = defaults * len(flags) if len(defaults) == 1 else defaults
        assert len(defaults) == len(flags), (flags, default_cell)
        expected_env: set[str] = set()
        for flag, default in zip(flags, defaults, strict=True):
            assert flag in actions, f"{flag}: in docs/operations.md, not in `kvpilot serve --help`"
            documented.add(flag)
            expected_env |= _env(actions[flag])
            value = EFFECTIVE_DEFAULTS.get(flag, actions[flag].default)
            assert _matches(default, value), f"{flag}: the table says {default!r}, --help {value!r}"
        assert set(envs) == expected_env, f"{flags}: the table says {envs}, --help {expected_env}"
    missing = set(actions) - documented - GLOBAL
    assert not missing, f"serve flags missing from the table in docs/operations.md: {missing}"


def _code(text: str) -> Iterator[str]:
    """Code blocks and code spans, with backslash-continued lines joined."""
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        yield block.replace("\\\n", " ")
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    yield from re.findall(r"`([^`\n]+)`", prose)


def _invocations(code: str) -> Iterator[tuple[str, list[str]]]:
    """(command, flags) of each `kvpilot COMMAND ...` in a piece of code."""
    for match in re.finditer(r"\bkvpilot((?:\s+--(?:server|token)\s+\S+)*)\s+([a-z][a-z-]*)", code):
        command = match.group(2)
        rest = re.split(r"\||&&|;|\)|\n|#", code[match.end() :], maxsplit=1)[0]
        yield command, re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_kvpilot_command_shown_uses_flags_it_has(page: Path) -> None:
    wrong = []
    for code in _code(page.read_text()):
        for command, flags in _invocations(code):
            if command not in COMMANDS:
                continue  # prose such as `kvpilot serve's` flags, or a path
            known = _flags(COMMANDS[command]) | GLOBAL
            wrong += [f"kvpilot {command} {flag}" for flag in flags if flag not in known]
    assert not wrong, f"{page.name} shows flags the commands do not have: {wrong}"


def _bench_invocations(code: str) -> Iterator[tuple[str, list[str]]]:
    """(benchmark, flags) of each `python -m bench ...` and `BENCH_ARGS="..."` in some code."""
    for match in re.finditer(r"python -m bench(?![.\w])|BENCH_ARGS=\"?", code):
        rest = re.split(r"\||&&|;|\)|\n|#|\"", code[match.end() :], maxsplit=1)[0]
        words = rest.split()
        name = words[0] if words and words[0] in BENCHMARKS else DEFAULT_BENCHMARK
        yield name, re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_benchmark_command_shown_uses_flags_it_has(page: Path) -> None:
    wrong = []
    for code in _code(page.read_text()):
        for name, flags in _bench_invocations(code):
            known = _flags(BENCHMARKS[name]) | {"--help", "-h"}
            wrong += [f"python -m bench {name} {flag}" for flag in flags if flag not in known]
    assert not wrong, f"{page.name} shows benchmark flags that do not exist: {wrong}"


def test_the_checks_catch_a_wrong_flag_and_a_wrong_default() -> None:
    """The comparisons above can fail."""
    assert list(_invocations("kvpilot serve --xds-adress 1")) == [("serve", ["--xds-adress"])]
    assert list(_invocations("kvpilot --token t apply -f x")) == [("apply", [])]
    assert not _matches("0.5 s", 0.25) and _matches("0.25 s", 0.25)
    assert not _matches("off", None) and _matches("none: CORS closed", [])
    assert list(_bench_invocations('BENCH_ARGS="controlplane --only acks --nope"')) == [
        ("controlplane", ["--only", "--nope"])
    ]
