"""`kvpilot agent`: scrape model servers' metrics into etcd, under a lease.

The command line of ``controlplane.agent``: its flags (etcd's, the pool and the log level also
from the environment, for containers), their check into an ``AgentConfig`` with a sentence for every bad input, and a run
until SIGINT or SIGTERM that revokes the lease on the way out. Runs as ``kvpilot agent`` or
``python -m commands.agent``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from commands.flags import env_flag, log_level_flag
from controlplane.agent.notice import NoticeSource
from controlplane.agent.scrape import Agent, AgentConfig, Target
from controlplane.etcd import EtcdAccessDenied
from controlplane.etcd.settings import add_etcd_arguments, etcd_settings, open_client
from controlplane.etcd.store import Store
from controlplane.logs import setup_logging
from policies import CAPACITIES, Endpoint
from signals.telemetry import METRIC_MAPS, MetricMap

log = logging.getLogger("kvpilot.agent")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `agent` subcommand's flags; etcd's, the pool and the log level read an environment
    variable too, for containers."""
    add_etcd_arguments(
        parser,
        default_endpoints="127.0.0.1:2379",
        endpoints_help="comma-separated host:port list of the etcd cluster "
        "(env KVPILOT_ETCD_ENDPOINTS)",
    )
    env_flag(parser, "--pool", help="pool of the backends")
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="model server base URL, e.g. http://10.0.0.5:8000; repeat for several",
    )
    parser.add_argument(
        "--targets-file",
        type=Path,
        help="YAML list of backends: "
        "[{pool, url, address?, port?, name?, weight?, maxRunning?, metricsPath?, region?, "
        "zone?, capacity?}]",
    )
    parser.add_argument(
        "--advertise-address",
        help="address to register instead of the --backend URL's host (one backend only)",
    )
    parser.add_argument(
        "--name",
        default="",
        help="stable name to register the backend under, e.g. its pod name: session affinity "
        "keeps its sessions when it comes back on a new address (one backend only)",
    )
    parser.add_argument(
        "--format",
        default="vllm",
        choices=[*METRIC_MAPS, "custom"],
        help="metric names to read (default vllm)",
    )
    parser.add_argument(
        "--metric-map",
        type=Path,
        help='YAML/JSON map for --format custom, e.g. {"waiting": "queue_len", ...}',
    )
    parser.add_argument("--metrics-path", default="/metrics", help="default /metrics")
    parser.add_argument(
        "--models-path",
        default=None,
        help="where the server lists its models and loaded LoRA adapters (default: "
        "/v1/models for vllm and sglang, /info for tgi; 'none' to not read them)",
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between scrapes (default 1)"
    )
    parser.add_argument(
        "--refresh",
        type=float,
        default=6.0,
        help="rewrite a record that stayed within its band this often, seconds; keep it "
        "below the pool's telemetry maxAge minus --interval (default 6)",
    )
    parser.add_argument(
        "--ttl",
        type=int,
        default=10,
        help="lease TTL, seconds: telemetry and registrations vanish this long after the "
        "agent dies (default 10)",
    )
    parser.add_argument(
        "--register", action="store_true", help="also register each backend in its pool"
    )
    parser.add_argument("--weight", type=int, default=100, help="registered weight (default 100)")
    parser.add_argument(
        "--max-running",
        type=float,
        help="batch capacity when the server does not export it (vLLM --max-num-seqs; times "
        "--data-parallel-size for a data-parallel vLLM behind one port)",
    )
    parser.add_argument("--region", default="", help="region registered with the backends")
    parser.add_argument(
        "--zone", default="", help="zone (within --region) registered with the backends"
    )
    parser.add_argument(
        "--capacity",
        default="",
        choices=["", *CAPACITIES],
        help="how the backends' machines are bought: on-demand, spot or reserved",
    )
    parser.add_argument(
        "--preemption-notice",
        action="append",
        default=[],
        metavar="SOURCE",
        help="where a preemption notice appears: aws, gcp, file:PATH or an http(s) URL; "
        "once one does, every backend is registered as draining (repeat for several)",
    )
    parser.add_argument(
        "--metadata-url",
        default="",
        help="base URL of the cloud metadata service for --preemption-notice aws or gcp "
        "(default http://169.254.169.254 for aws, http://metadata.google.internal for gcp)",
    )
    parser.add_argument(
        "--notice-interval",
        type=float,
        default=1.0,
        help="seconds between looks at the notice sources (default 1)",
    )
    parser.add_argument(
        "--unregister-after",
        type=int,
        default=3,
        help="withdraw a registration after this many failed scrapes in a row (default 3)",
    )
    log_level_flag(parser)


def _models_path(value: str | None) -> str | None:
    if value is None:
        return None
    if value == "none":
        return ""
    if not value.startswith("/"):
        raise ValueError(f"--models-path {value!r} must start with '/' (or be 'none')")
    return value


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Turn parsed flags into an AgentConfig; ``ValueError`` with a sentence on bad input."""
    targets: list[Target] = []
    for url in args.backend:
        if not args.pool:
            raise ValueError("--backend needs --pool (or use --targets-file)")
        targets.append(
            Target(
                pool=args.pool,
                url=url,
                address=args.advertise_address or "",
                weight=args.weight,
                name=args.name,
                metrics_path=args.metrics_path,
                models_path=_models_path(args.models_path),
                max_running=args.max_running,
                region=args.region,
                zone=args.zone,
                capacity=args.capacity,
            )
        )
    if args.targets_file:
        entries = yaml.safe_load(args.targets_file.read_text()) or []
        if not isinstance(entries, list):
            raise ValueError(f"{args.targets_file}: expected a YAML list of backends")
        for entry in entries:
            targets.append(
                Target(
                    pool=entry.get("pool") or args.pool,
                    url=entry["url"],
                    address=entry.get("address", ""),
                    port=int(entry.get("port", 0)),
                    weight=int(entry.get("weight", args.weight)),
                    name=str(entry.get("name", "")),
                    metrics_path=entry.get("metricsPath", args.metrics_path),
                    models_path=_models_path(entry.get("modelsPath", args.models_path)),
                    max_running=entry.get("maxRunning", args.max_running),
                    region=str(entry.get("region", args.region)),
                    zone=str(entry.get("zone", args.zone)),
                    capacity=str(entry.get("capacity", args.capacity)),
                )
            )
    if not targets:
        raise ValueError("nothing to scrape: give --pool and --backend URL, or --targets-file")
    if args.advertise_address and len(targets) > 1:
        raise ValueError("--advertise-address applies to a single --backend")
    if args.name and len(targets) > 1:
        raise ValueError("--name applies to a single --backend; name each in --targets-file")
    for target in targets:
        _check_registration(target)
    notices = [NoticeSource.parse(text, args.metadata_url) for text in args.preemption_notice]
    if args.notice_interval <= 0:
        raise ValueError("--notice-interval must be above 0")
    metric_map = None
    if args.metric_map:
        metric_map = MetricMap.from_mapping(yaml.safe_load(args.metric_map.read_text()) or {})
    if args.format == "custom" and metric_map is None:
        raise ValueError("--format custom needs --metric-map FILE")
    if args.ttl < 1 or args.interval <= 0:
        raise ValueError("--ttl must be at least 1 and --interval above 0")
    etcd = etcd_settings(args, os.environ)
    return AgentConfig(
        etcd_endpoints=etcd.endpoints,
        targets=targets,
        prefix=etcd.prefix,
        format=args.format,
        metric_map=metric_map,
        interval=args.interval,
        ttl=args.ttl,
        refresh=args.refresh,
        register=args.register,
        unregister_after=args.unregister_after,
        etcd_security=etcd.security,
        notices=notices,
        notice_interval=args.notice_interval,
    )


_FLAGS = {"locality.region": "--region", "locality.zone": "--zone", "capacity": "--capacity"}


def _check_registration(target: Target) -> None:
    """Refuse a backend whose registration kvpilot would refuse (an unknown capacity kind, a
    zone without a region), naming the flag, before anything is written."""
    try:
        Endpoint.model_validate(target.endpoint_body())
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        flag = next((f for field, f in _FLAGS.items() if where.startswith(field)), where)
        if where == "locality":
            flag = "--zone"
        raise ValueError(f"{target.url}: {flag}: {first['msg']}") from None


async def run_agent(config: AgentConfig) -> None:
    """Run until SIGINT/SIGTERM (or cancellation); revoke the lease on the way out."""
    client = await open_client(
        config.etcd_endpoints, config.etcd_security, meanwhile="the agent starts and keeps trying"
    )
    agent = Agent(Store(client, config.prefix), config)
    task = asyncio.create_task(agent.run(), name="agent")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("agent stopping")
    finally:
        await client.close()


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvpilot agent`."""
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except (ValueError, KeyError, OSError) as error:
        log.error("%s", error)
        return 2
    try:
        asyncio.run(run_agent(config))
    except EtcdAccessDenied as error:
        log.error("%s", error)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpilot agent", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
