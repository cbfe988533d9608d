"""`make demo`: the whole path on one machine, on embedded defaults.

REST API -> etcd -> kvpilot -> ADS -> Envoy -> model replicas. It starts an embedded etcd,
`kvpilot serve`, three simulated replicas and one real Envoy; applies
`policies/examples/demo.yaml` through the REST API; sends requests through Envoy and shows
which replica answered; then changes one endpoint's weight and removes another through the API
and shows the traffic follow. Everything it started is stopped at the end (or on Ctrl-C).

    python -m commands.demo [--keep] [--requests N]

With ``--keep`` (or ``KVPILOT_DEMO_KEEP=1``) it stays up and prints curl lines to try.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from api.client import KvpilotClient
from controlplane.local import (
    EmbeddedEnvoy,
    LocalStack,
    free_port,
    local_stack,
    repo_root,
    wait_until,
)
from controlplane.local.replicas import BackendProcess
from policies import load_objects

EXAMPLE = repo_root() / "policies" / "examples" / "demo.yaml"


def _say(text: str = "") -> None:
    print(text, flush=True)


def send(url: str, count: int) -> collections.Counter[str]:
    """Send `count` chat completions through Envoy; count which replica answered each."""
    served: collections.Counter[str] = collections.Counter()
    with httpx.Client(timeout=10) as http:
        for index in range(count):
            response = http.post(
                url,
                json={
                    "model": "demo-model",
                    "messages": [{"role": "user", "content": f"hi {index}"}],
                },
            )
            served[response.headers.get("x-backend-id", f"HTTP {response.status_code}")] += 1
    return served


def table(title: str, served: collections.Counter[str], replicas: list[str]) -> str:
    """A short table: replica, requests, share, bar."""
    total = sum(served.values()) or 1
    lines = [title, f"  {'replica':<10} {'requests':>8} {'share':>6}"]
    for name in [*replicas, *sorted(set(served) - set(replicas))]:
        count = served.get(name, 0)
        lines.append(
            f"  {name:<10} {count:>8} {count / total:>6.0%}  {'#' * round(40 * count / total)}"
        )
    return "\n".join(lines)


def _policy_documents(ports: list[int], listener_port: int) -> list[dict[str, Any]]:
    """The example policy with the replicas' and the listener's real ports filled in."""
    documents = []
    for obj in load_objects(EXAMPLE):
        body = obj.model_dump(mode="json", by_alias=True)
        if body["kind"] == "Pool":
            body["spec"]["endpoints"] = [
                {"address": "127.0.0.1", "port": port, "weight": 100} for port in ports
            ]
        if body["kind"] == "RoutingPolicy":
            body["spec"]["listener"]["port"] = listener_port
        documents.append(body)
    return documents


@contextlib.contextmanager
def _stack(state_dir: Path, replicas: int) -> Iterator[tuple[LocalStack, BackendProcess]]:
    _say("starting etcd, kvpilot, replicas and Envoy (all local, free ports) ...")
    backends = BackendProcess(replicas, id_prefix="replica", state_dir=state_dir / "backends")
    # The replicas need nothing from the stack: they start while etcd, kvpilot and Envoy do.
    backends.spawn()
    try:
        with local_stack(state_dir, node_id="demo-envoy-1") as stack:
            yield stack, backends.wait_started()
    finally:
        backends.stop()


QUICKSTART = "docs/quickstart.md"


def next_steps(
    *, api_url: str, token: str, chat_url: str, envoy_admin_url: str, endpoint: str
) -> str:
    """What to try once the demo has run: the console, a request through Envoy, a weight
    change, what Envoy holds, and the quickstart (the same path with your own pieces)."""
    cli = Path(sys.executable).parent / "kvpilot"
    with contextlib.suppress(ValueError):
        cli = cli.relative_to(Path.cwd())
    body = '{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}'
    return "\n".join(
        [
            f"  the console:      {api_url}/ui/ (sign in with the token {token})",
            f"  a request:        curl -s {chat_url} -H 'content-type: application/json' \\",
            f"                      -d '{body}'",
            f"  a weight change:  {cli} --server {api_url} --token {token} \\",
            f"                      set-weight demo-pool {endpoint} 300",
            f"  kvpilot's view:   {cli} --server {api_url} --token {token} status",
            f"  Envoy's view:     curl -s {envoy_admin_url}/clusters",
            f"  your own fleet:   {QUICKSTART} (certificates, agent and Envoy in six commands)",
        ]
    )


def _served_weight(envoy: EmbeddedEnvoy, port: int) -> int | None:
    """The weight Envoy currently uses for the endpoint on `port` (admin /clusters)."""
    for line in envoy.clusters().splitlines():
        if f"127.0.0.1:{port}::weight::" in line:
            return int(line.rsplit("::", 1)[1])
    return None


def run(keep: bool, requests: int, state_dir: Path) -> int:
    """Run the demo; returns the exit code."""
    with _stack(state_dir, replicas=3) as (stack, backends):
        kvpilot, envoy, token = stack.kvpilot, stack.envoy, stack.admin_token
        replicas = [replica.id for replica in backends.replicas]
        ports = [replica.port for replica in backends.replicas]
        listener_port = free_port()
        url = f"http://127.0.0.1:{listener_port}/v1/chat/completions"
        client = KvpilotClient(kvpilot.api_url, token=token)

        _say(
            f"\n1. apply {EXAMPLE.relative_to(repo_root())} through the REST API ({kvpilot.api_url})"
        )
        for body in _policy_documents(ports, listener_port):
            client.apply(body)
            _say(f"   {body['kind']}/{body['metadata']['name']} applied")
        wait_until(
            lambda: all(_served_weight(envoy, port) == 100 for port in ports),
            30,
            "Envoy to receive the policy",
        )
        envoy.wait_ready(30)
        _say(f"\n2. {requests} requests through Envoy (round robin, equal weights)")
        _say(table("", send(url, requests), replicas))

        first, _, last = backends.replicas
        _say(f"\n3. set the weight of {first.id} (127.0.0.1:{first.port}) to 800 through the API")
        client.set_weight("demo-pool", f"127.0.0.1:{first.port}", 800)
        wait_until(
            lambda: _served_weight(envoy, first.port) == 800, 30, "the new weight to reach Envoy"
        )
        _say(table("", send(url, requests), replicas))

        _say(f"\n4. remove {last.id} (127.0.0.1:{last.port}) from the pool through the API")
        pool = client.get("Pool", "demo-pool")
        pool["spec"]["endpoints"] = [e for e in pool["spec"]["endpoints"] if e["port"] != last.port]
        client.apply(pool)
        wait_until(
            lambda: _served_weight(envoy, last.port) is None, 30, "the endpoint to leave Envoy"
        )
        final = send(url, requests)
        _say(table("", final, replicas))
        if final.get(last.id):
            _say(f"error: {last.id} still served requests after its removal")
            return 1

        status = client.status()
        for connection in status["envoys"]:
            _say(
                f"\nEnvoy {connection.get('node_id')} (fleet {connection.get('fleet')}) is connected over ADS"
            )
        tries = next_steps(
            api_url=kvpilot.api_url,
            token=token,
            chat_url=url,
            envoy_admin_url=envoy.admin_url,
            endpoint=f"127.0.0.1:{first.port}",
        )
        if keep:
            _say("\nStill running (Ctrl-C stops everything). Try:")
            _say(tries)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
        else:
            _say(
                "\nWhat to try next: `make demo DEMO_ARGS=--keep` keeps it all running, so you can"
            )
            _say("try these (the ports change from run to run):")
            _say(tries)
        _say("\nstopping everything ...")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        default=os.environ.get("KVPILOT_DEMO_KEEP") == "1",
        help="stay up after the demo and print curl lines",
    )
    parser.add_argument("--requests", type=int, default=30, help="requests per step (default 30)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where logs and data go (default: a temporary directory)",
    )
    args = parser.parse_args(argv)
    if args.state_dir is not None:
        return run(args.keep, args.requests, args.state_dir)
    with tempfile.TemporaryDirectory(prefix="kvpilot-demo-") as tmp:
        return run(args.keep, args.requests, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
