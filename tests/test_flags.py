"""The flags of `kvpilot serve` and `kvpilot agent`: one definition each, the environment
variable named from the flag, its value checked like a typed one, the defaults the config's."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from commands import agent, serve_config
from commands.flags import env_name
from commands.serve_config import ServeConfig, add_arguments, config_from_args


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpilot serve")
    add_arguments(parser)
    return parser


@pytest.mark.parametrize(
    ("flag", "env"),
    [
        ("--write-burst", "KVPILOT_WRITE_BURST"),
        ("--xds-client-ca", "KVPILOT_XDS_CLIENT_CA"),
        ("--log-level", "KVPILOT_LOG_LEVEL"),
    ],
)
def test_the_variable_is_named_from_the_flag(flag: str, env: str) -> None:
    assert env_name(flag) == env


def test_an_environment_value_is_the_default_and_a_flag_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPILOT_WRITE_BURST", "7")
    monkeypatch.setenv("KVPILOT_ROLLOUT_LEASE_TTL", "30")
    args = serve_parser().parse_args(["--rollout-lease-ttl", "12"])
    assert args.write_burst == 7
    assert args.rollout_lease_ttl == 12


def test_a_bad_environment_value_is_refused_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVPILOT_WRITE_BURST", "lots")
    with pytest.raises(SystemExit):
        serve_parser().parse_args([])
    assert "--write-burst: invalid int value: 'lots'" in capsys.readouterr().err


def test_a_list_from_the_environment_takes_the_flags_given_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPILOT_NODE_FLEETS", "a=edge,b=core")
    args = serve_parser().parse_args(["--node-fleet", "c=edge"])
    assert args.node_fleet == ["a=edge", "b=core", "c=edge"]


def test_the_flags_defaults_are_the_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("KVPILOT_")]:
        monkeypatch.delenv(name)
    config = config_from_args(serve_parser().parse_args(["--xds-insecure-plaintext"]))
    defaults = ServeConfig()
    differ = [
        field.name
        for field in dataclasses.fields(ServeConfig)
        if field.name not in {"replica_id", "xds_insecure_plaintext", "etcd_security"}
        and getattr(config, field.name) != getattr(defaults, field.name)
    ]
    assert not differ, f"flag defaults that are not ServeConfig's: {differ}"
    assert serve_config._default("quiet_period") == defaults.quiet_period


def test_the_agent_reads_its_pool_and_log_level_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVPILOT_POOL", "chat")
    monkeypatch.setenv("KVPILOT_LOG_LEVEL", "debug")
    parser = argparse.ArgumentParser(prog="kvpilot agent")
    agent.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.pool, args.log_level) == ("chat", "debug")
