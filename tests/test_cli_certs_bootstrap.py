"""`kvpilot certs`, `kvpilot bootstrap`, `kvpilot completion` and `kvpilot --version`, offline:
what they write and print, what they refuse, and that the generated bootstrap says what the
reference files in deploy/envoy/ say."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from commands.cli import build_parser, main
from commands.cli.bootstrap import REFERENCE_SDS_DIR
from controlplane.local import find_binary, repo_root

DEPLOY = repo_root() / "deploy" / "envoy"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit:
        code = int(exit.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root`: file contents, symlink targets."""
    entries: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            entries[name] = f"-> {os.readlink(path)}"
        elif path.is_file():
            entries[name] = path.read_bytes()
        else:
            entries[name] = "dir"
    return entries


def validate(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(find_binary("envoy")),
            "--mode",
            "validate",
            "-c",
            str(config),
            "--use-dynamic-base-id",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- --version and completion -------------------------------------------------------------------


def test_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0
    assert out.strip() == f"kvpilot {importlib.metadata.version('kvpilot')}"


def complete(script: str, line: str) -> list[str]:
    """What bash offers for `line` (the cursor at its end) with the completion `script`."""
    words = line.split(" ")
    program = (
        script
        + "\nCOMP_WORDS=("
        + " ".join(f"'{w}'" for w in words)
        + f")\nCOMP_CWORD={len(words) - 1}\n_kvpilot\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n"
    )
    result = subprocess.run(
        ["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    return [w for w in result.stdout.splitlines() if w]


@pytest.fixture(scope="module")
def bash_script() -> str:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    return subprocess.run(
        [sys.executable, "-m", "commands.cli", "completion", "bash"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


@pytest.mark.parametrize(
    ("line", "expected", "absent"),
    [
        ("kvpilot ", {"serve", "certs", "bootstrap", "completion", "rollout"}, {"--fleet"}),
        ("kvpilot ce", {"certs"}, {"serve"}),
        ("kvpilot --", {"--version", "--server", "--token", "--help"}, {"--fleet"}),
        (
            "kvpilot bootstrap --",
            {"--fleet", "--xds", "--delta", "--tls-dir", "--plaintext"},
            set(),
        ),
        ("kvpilot --server http://x bootstrap --d", {"--delta"}, {"--fleet"}),
        ("kvpilot completion ", {"bash", "zsh"}, set()),
        ("kvpilot get -o ", {"table", "yaml", "json"}, set()),
        ("kvpilot rollout ", {"status"}, {"serve"}),
        ("kvpilot bootstrap --fleet ", set(), {"--xds", "serve"}),
        ("kvpilot certs --fleet a --", {"--out", "--trust-domain"}, set()),
    ],
)
def test_bash_completion_offers_what_the_parser_accepts(
    bash_script: str, line: str, expected: set[str], absent: set[str]
) -> None:
    offered = set(complete(bash_script, line))
    assert expected <= offered, offered
    assert not absent & offered


def test_bash_completion_covers_every_subcommand_and_option(bash_script: str) -> None:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]
    assert subparsers.choices is not None
    for name, child in subparsers.choices.items():
        assert isinstance(child, type(parser))
        options = {o for a in child._actions for o in a.option_strings}
        assert options <= set(complete(bash_script, f"kvpilot {name} -")), name


def test_completion_directory_option_completes_directories(
    bash_script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "certs-dir").mkdir()
    (tmp_path / "certs-file").write_text("")
    monkeypatch.chdir(tmp_path)
    assert complete(bash_script, "kvpilot bootstrap --tls-dir cer") == ["certs-dir"]


def test_zsh_completion_offers_what_the_parser_accepts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "completion", "zsh")
    assert code == 0
    assert "bashcompinit" in out and "complete -o default -F _kvpilot kvpilot" in out
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed: only the script's shape was checked")
    (tmp_path / "kvpilot.zsh").write_text(out)
    # What zsh's _bash_complete does on <Tab>, without a terminal: zsh then filters the
    # candidates by the word typed itself.
    program = f"""
source {tmp_path / "kvpilot.zsh"}
words=(kvpilot --server x bootstrap --d); CURRENT=$#words
COMP_WORDS=("${{words[@]}}"); COMP_CWORD=$((CURRENT - 1))
compgen -F _kvpilot -- "${{words[CURRENT]}}"
"""
    result = subprocess.run(
        ["zsh", "-f", "-c", program],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    offered = set(result.stdout.split())
    assert {"--delta", "--fleet", "--tls-dir"} <= offered, result.stdout
    assert "serve" not in offered


# -- certs --------------------------------------------------------------------------------------


def test_certs_makes_fleet_identities_and_prints_the_flags_to_use_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = tmp_path / "pki"
    code, out, err = run(
        capsys,
        "certs",
        "--out",
        str(out_dir),
        "--fleet",
        "edge",
        "--fleet",
        "batch",
        "--trust-domain",
        "example.org",
    )
    assert code == 0, err
    for fleet in ("edge", "batch"):
        cert = x509.load_pem_x509_certificate((out_dir / f"envoy-{fleet}" / "tls.crt").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        assert uris == [f"spiffe://example.org/fleet/{fleet}"]
        assert f"--xds-identity-fleet spiffe://example.org/fleet/{fleet}={fleet}" in out
        assert f"--tls-dir {out_dir}/envoy-{fleet}" in out
        # Each fleet's directory holds the SDS files its bootstrap reads, naming its own files.
        sds = yaml.safe_load((out_dir / f"envoy-{fleet}" / "certificate.yaml").read_text())
        secret = sds["resources"][0]["tls_certificate"]
        assert secret["private_key"]["filename"] == f"{out_dir}/envoy-{fleet}/tls.key"
        assert (out_dir / f"envoy-{fleet}" / "tls.key").stat().st_mode & 0o077 == 0
    server = x509.load_pem_x509_certificate((out_dir / "kvpilot" / "tls.crt").read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kvpilot" in sans.get_values_for_type(x509.DNSName)
    assert f"--xds-cert {out_dir}/kvpilot/tls.crt" in out
    assert f"--xds-client-ca {out_dir}/kvpilot/ca.crt" in out
    assert (out_dir / "kvpilot" / "ca.crt").read_bytes() == (out_dir / "ca.crt").read_bytes()
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")]
    # 90 days by default, and the CA outlives the certificates it signed.
    ca = x509.load_pem_x509_certificate((out_dir / "ca.crt").read_bytes())
    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert datetime.timedelta(days=90) <= lifetime <= datetime.timedelta(days=90, minutes=10)
    assert ca.not_valid_after_utc > server.not_valid_after_utc


def test_certs_days_sets_the_lifetime_and_refuses_nonsense(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, "certs", "--out", str(tmp_path / "a"), "--days", "7")
    assert code == 0, err
    cert = x509.load_pem_x509_certificate((tmp_path / "a" / "kvpilot" / "tls.crt").read_bytes())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=7) <= lifetime <= datetime.timedelta(days=7, minutes=10)
    for bad in ("0", "seven", "4000"):
        code, _, err = run(capsys, "certs", "--out", str(tmp_path / "b"), "--days", bad)
        assert code == 2 and "--days" in err
        assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "existing", ["ca.crt", "kvpilot/tls.key", "envoy-edge/tls.key", "envoy-edge"]
)
def test_certs_refuses_to_overwrite_and_changes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, existing: str
) -> None:
    out_dir = tmp_path / "pki"
    (out_dir / existing).parent.mkdir(parents=True, exist_ok=True)
    if existing == "envoy-edge":
        (out_dir / existing).mkdir()
    else:
        (out_dir / existing).write_text("keep me")
    (out_dir / "unrelated.txt").write_text("mine")
    before = tree(out_dir)
    code, out, err = run(capsys, "certs", "--out", str(out_dir), "--fleet", "edge")
    assert code == 1
    assert "refusing to overwrite" in err and str(out_dir / existing.split("/")[0]) in err
    assert out == ""
    assert tree(out_dir) == before


def test_certs_run_twice_keeps_the_first_keys(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run(capsys, "certs", "--out", str(tmp_path), "--fleet", "edge")[0] == 0
    before = tree(tmp_path)
    code, _, err = run(capsys, "certs", "--out", str(tmp_path), "--fleet", "edge")
    assert code == 1 and "refusing to overwrite" in err
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fleet", "Bad_Fleet"], "--fleet 'Bad_Fleet'"),
        (["--trust-domain", "Example.ORG/x"], "--trust-domain"),
        (["--server-ip", "300.1.1.1"], "--server-ip '300.1.1.1'"),
        (["--server-dns", "no spaces"], "--server-dns"),
        (["--xds-address", "nowhere"], "--xds-address 'nowhere'"),
        (["--envoy-tls-path", "relative/dir"], "--envoy-tls-path"),
    ],
)
def test_certs_bad_flags_name_the_flag_and_write_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    code, _, err = run(capsys, "certs", "--out", str(tmp_path / "pki"), *argv)
    assert code == 1
    assert message in err
    assert not (tmp_path / "pki").exists()


def test_certs_without_cryptography_says_how_to_install_it(tmp_path: Path) -> None:
    program = (
        "import sys; sys.modules['cryptography'] = None\n"
        "from commands.cli import main\n"
        f"sys.exit(main(['certs', '--out', {str(tmp_path / 'pki')!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "pip install 'kvpilot[local]'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "pki").exists()


def test_certs_sds_files_for_the_reference_paths_equal_the_reference_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(
        capsys, "certs", "--out", str(tmp_path), "--envoy-tls-path", "/etc/envoy/xds-tls"
    )
    assert code == 0, err
    for name in ("certificate.yaml", "validation.yaml"):
        made = yaml.safe_load((tmp_path / "envoy-default" / name).read_text())
        assert made == yaml.safe_load((DEPLOY / "xds-tls" / name).read_text()), name


# -- bootstrap ----------------------------------------------------------------------------------


def bootstrap(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, "bootstrap", *argv)
    assert code == 0, err
    config: dict[str, Any] = yaml.safe_load(out)
    return config


@pytest.mark.parametrize(
    ("reference", "flags"), [("bootstrap.yaml", []), ("bootstrap-delta.yaml", ["--delta"])]
)
def test_bootstrap_for_the_reference_parameters_is_the_reference_file(
    capsys: pytest.CaptureFixture[str], reference: str, flags: list[str]
) -> None:
    """The reference sets node.id and node.cluster on Envoy's command line; everything else is
    the same, key by key, for its address (kvpilot:18000), admin port and SDS directory."""
    made = bootstrap(
        capsys, "--fleet", "default", "--xds", "kvpilot:18000", "--node-id", "envoy-1", *flags
    )
    assert made.pop("node") == {"id": "envoy-1", "cluster": "default"}
    assert made == yaml.safe_load((DEPLOY / reference).read_text())


def test_bootstrap_points_tls_at_the_given_directory_or_drops_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert run(capsys, "certs", "--out", str(tmp_path), "--fleet", "edge")[0] == 0
    tls_dir = tmp_path / "envoy-edge"
    made = bootstrap(capsys, "--fleet", "edge", "--xds", "[::1]:18001", "--tls-dir", str(tls_dir))
    for cluster in made["static_resources"]["clusters"]:
        address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        assert address["address"]["socket_address"] == {"address": "::1", "port_value": 18001}
        context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
        source = context["tls_certificate_sds_secret_configs"][0]["sds_config"]
        assert source["path_config_source"]["path"] == f"{tls_dir}/certificate.yaml"
    plain = bootstrap(capsys, "--fleet", "edge", "--xds", "h:1", "--plaintext")
    assert all("transport_socket" not in c for c in plain["static_resources"]["clusters"])
    assert plain["node"]["cluster"] == "edge" and plain["node"]["id"].startswith("edge-")


@pytest.mark.parametrize("mode", ["tls", "delta", "plaintext"])
def test_generated_bootstrap_passes_envoy_validation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, mode: str
) -> None:
    assert run(capsys, "certs", "--out", str(tmp_path / "pki"), "--fleet", "edge")[0] == 0
    flags = {
        "tls": ["--tls-dir", str(tmp_path / "pki" / "envoy-edge")],
        "delta": ["--delta", "--tls-dir", str(tmp_path / "pki" / "envoy-edge")],
        "plaintext": ["--plaintext"],
    }[mode]
    code, out, err = run(capsys, "bootstrap", "--fleet", "edge", "--xds", "127.0.0.1:1", *flags)
    assert code == 0, err
    (tmp_path / "envoy.yaml").write_text(out)
    result = validate(tmp_path / "envoy.yaml")
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--xds", "localhost"], "--xds 'localhost': expected HOST:PORT"),
        (["--xds", "host:"], "--xds 'host:': expected HOST:PORT"),
        (["--xds", "host:70000"], "port 70000 is not between 1 and 65535"),
        (["--xds", "::1:18000"], "expected HOST:PORT"),
        (["--xds", "[not-v6]:18000"], "expected HOST:PORT"),
        (["--xds", "h:1", "--admin-port", "-1"], "--admin-port -1"),
        (["--xds", "h:1", "--node-id", " "], "--node-id"),
    ],
)
def test_bootstrap_bad_flags_are_a_clear_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, "bootstrap", "--fleet", "edge", *argv)
    assert code == 1
    assert message in err and out == ""


def test_bootstrap_bad_fleet_and_conflicting_tls_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "bootstrap", "--fleet", "Edge", "--xds", "h:1")
    assert code == 1 and "--fleet 'Edge'" in err
    code, _, err = run(
        capsys, "bootstrap", "--fleet", "e", "--xds", "h:1", "--plaintext", "--tls-dir", "d"
    )
    assert code == 2 and "not allowed with" in err


def test_bootstrap_default_tls_dir_is_the_reference_one(capsys: pytest.CaptureFixture[str]) -> None:
    made = bootstrap(capsys, "--fleet", "edge", "--xds", "h:1")
    (xds, _) = made["static_resources"]["clusters"]
    context = xds["transport_socket"]["typed_config"]["common_tls_context"]
    path = context["validation_context_sds_secret_config"]["sds_config"]["path_config_source"]
    assert path["path"] == f"{REFERENCE_SDS_DIR}/validation.yaml"


def test_certs_default_output_is_what_the_compose_file_mounts_and_binds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`kvpilot certs --out deploy/tls` is the compose recipe: every TLS directory compose
    mounts exists, and the identity compose binds is the one the Envoy certificate carries."""
    compose = yaml.safe_load((repo_root() / "deploy" / "compose.yaml").read_text())["services"]
    code, out, err = run(capsys, "certs", "--out", str(tmp_path / "tls"))
    assert code == 0, err
    mounts = [
        volume.split(":")[0]
        for service in ("kvpilot", "envoy")
        for volume in compose[service]["volumes"]
        if volume.startswith("./tls/")
    ]
    assert len(mounts) == 2
    for mount in mounts:
        assert (tmp_path / mount / "tls.key").is_file(), mount
    (binding,) = [
        arg.split("=", 1)[1]
        for arg in compose["kvpilot"]["command"]
        if arg.startswith("--xds-identity-fleet=")
    ]
    assert f"--xds-identity-fleet {binding}" in out
