"""``kvpilot completion bash|zsh``: a shell completion script generated from the CLI's own
argparse parser, so it never drifts from ``--help``.

No dependency: argcomplete completes by running the program on every <Tab> (kvpilot's import
takes a noticeable fraction of a second) and needs a hook in the entry point, and shtab is not
a standard one would expect to find installed. The script here is static: every command path,
its options, and the values an option takes (its choices, a file, a directory), read from the
parser. zsh runs the same function through ``bashcompinit``, which ships with zsh.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from commands.cli.common import AddParser

FLAG = "flag"
"""An option that takes no value."""
ANY = "any"
"""An option whose value cannot be guessed: complete nothing."""
FILE = "file"
DIRECTORY = "dir"


@dataclass
class Command:
    """What completion needs of one command path (``""`` for the top, ``"rollout"``, ...)."""

    path: str
    words: list[str] = field(default_factory=list)
    """Subcommands and the choices of positional arguments."""
    options: dict[str, str] = field(default_factory=dict)
    """Option string -> ``FLAG``, ``ANY``, ``FILE``, ``DIRECTORY`` or its space-separated
    choices."""


def _value_kind(action: argparse.Action) -> str:
    if action.nargs == 0:
        return FLAG
    if action.choices is not None:
        return " ".join(str(choice) for choice in action.choices)
    hint = f"{action.dest} {action.metavar or ''}".lower()
    if "dir" in hint.split("_") or "dir" in hint.split() or hint.endswith("_dir"):
        return DIRECTORY
    if action.type is Path or "file" in hint:
        return FILE
    return ANY


def commands(parser: argparse.ArgumentParser, path: str = "") -> Iterator[Command]:
    """Every command path of `parser`, depth first."""
    command = Command(path)
    children: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                command.words.append(name)
                children.append((name, child))
        elif action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            kind = _value_kind(action)
            for option in action.option_strings:
                command.options[option] = kind
        elif action.choices is not None:
            command.words.extend(str(choice) for choice in action.choices)
    yield command
    for name, child in children:
        yield from commands(child, f"{path} {name}".strip())


def _case(arms: list[tuple[str, str]]) -> list[str]:
    lines = ['    case "$1" in']
    for pattern, body in arms:
        quoted = shlex.quote(pattern) if pattern else '""'
        lines.append(f"        {quoted}) {body} ;;")
    lines.append("    esac")
    return lines


def bash_script(parser: argparse.ArgumentParser) -> str:
    """A bash completion script for `parser` (``complete -F _kvpilot kvpilot``)."""
    prog = parser.prog
    table = list(commands(parser))
    words = [(c.path, f"echo {shlex.quote(' '.join(c.words))}") for c in table if c.words]
    options = [(c.path, f"echo {shlex.quote(' '.join(c.options))}") for c in table]
    values = [
        (f"{c.path}|{option}", f"echo {shlex.quote(kind)}")
        for c in table
        for option, kind in c.options.items()
    ]
    fn = f"_{prog.replace('-', '_')}"
    lines = [
        f"# {prog} completion for bash, generated from its argument parser:",
        f'#   eval "$({prog} completion bash)"  (or save it in a bash-completion directory)',
        f"{fn}_words() {{",
        *_case(words),
        "}",
        f"{fn}_options() {{",
        *_case(options),
        "}",
        "# The value an option of a command takes: flag, any, file, dir or its choices.",
        f"{fn}_value() {{",
        *_case(values),
        "}",
        f"{fn}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="" path="" word kind i',
        '    [[ $COMP_CWORD -gt 0 ]] && prev="${COMP_WORDS[COMP_CWORD-1]}"',
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        word="${COMP_WORDS[i]}"',
        "        [[ $word == -* ]] && continue",
        f'        kind="$({fn}_value "$path|${{COMP_WORDS[i-1]}}")"',
        "        [[ -n $kind && $kind != flag && ${COMP_WORDS[i-1]} == -* ]] && continue",
        f'        if [[ " $({fn}_words "$path") " == *" $word "* ]]; then',
        f'            if [[ -n "$({fn}_options "${{path:+$path }}$word")" ]]; then',
        '                path="${path:+$path }$word"',
        "            fi",
        "        fi",
        "    done",
        "    if [[ $prev == -* ]]; then",
        f'        kind="$({fn}_value "$path|$prev")"',
        '        case "$kind" in',
        '            "" | flag) ;;',
        "            any) COMPREPLY=(); return ;;",
        '            file) COMPREPLY=($(compgen -f -- "$cur")); return ;;',
        '            dir) COMPREPLY=($(compgen -d -- "$cur")); return ;;',
        '            *) COMPREPLY=($(compgen -W "$kind" -- "$cur")); return ;;',
        "        esac",
        "    fi",
        "    if [[ $cur == -* ]]; then",
        f'        COMPREPLY=($(compgen -W "$({fn}_options "$path")" -- "$cur"))',
        "    else",
        f'        COMPREPLY=($(compgen -W "$({fn}_words "$path")" -- "$cur"))',
        "    fi",
        "}",
        f"complete -o default -F {fn} {prog}",
    ]
    return "\n".join(lines) + "\n"


def zsh_script(parser: argparse.ArgumentParser) -> str:
    """The bash function, run by zsh's own ``bashcompinit``."""
    prog = parser.prog
    header = [
        f"# {prog} completion for zsh, generated from its argument parser:",
        f'#   eval "$({prog} completion zsh)"  (in ~/.zshrc, after compinit)',
        "autoload -U +X compinit && { (( $+functions[compdef] )) || compinit; }",
        "autoload -U +X bashcompinit && bashcompinit",
    ]
    body = bash_script(parser).split("\n", 2)[2]
    return "\n".join(header) + "\n" + body


SHELLS = {"bash": bash_script, "zsh": zsh_script}


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(SHELLS[args.shell](args.root_parser))
    return 0


def add_parsers(add_parser: AddParser, root: argparse.ArgumentParser) -> None:
    """`completion`; `root` is the whole ``kvpilot`` parser the script describes."""
    parser = add_parser(
        "completion",
        help="print a shell completion script (bash or zsh)",
        description='Print a completion script for your shell: eval "$(kvpilot completion bash)" '
        "in ~/.bashrc, or the same with zsh in ~/.zshrc.",
    )
    parser.add_argument("shell", choices=sorted(SHELLS))
    parser.set_defaults(func=cmd_completion, root_parser=root)
