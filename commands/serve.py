"""`kvpilot serve`: the daemon.

It watches etcd, compiles policies into snapshots, serves them to Envoys over ADS (gRPC) and
serves the REST API. With no ``--etcd-endpoints`` it starts an embedded etcd under the state
directory, which is what local use and the demo want; production points at an etcd cluster.

This module wires the daemon's parts together and runs them; its flags and the
ServeConfig they make are in ``commands.serve_config``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

import grpc
import uvicorn
from prometheus_client import CollectorRegistry, Gauge

from api import ApiContext, create_app
from api.auth import AuthConfig, AuthConfigError, TokenReloader, WriteRateLimit
from commands.serve_config import ServeConfig, add_arguments, check_xds, config_from_args
from compiler.locality import batch_slots
from controlplane.arrivals import ArrivalBoard, ArrivalPublisher
from controlplane.asgi import UvicornServer
from controlplane.audit import AuditLog
from controlplane.envoystatus import StatusPublisher
from controlplane.envoystatus import records as envoy_records
from controlplane.etcd import EtcdAccessDenied
from controlplane.etcd.settings import open_client
from controlplane.etcd.store import Store
from controlplane.local import EmbeddedEtcd
from controlplane.logs import setup_logging
from controlplane.mirror import StateChange, StateMirror
from controlplane.prefillfits import FitBoard, FitPublisher
from controlplane.reconcile.budgets import BudgetWatcher
from controlplane.reconcile.difficulty import DifficultyLoop, virtual_models_of
from controlplane.reconcile.loop import Reconciler
from controlplane.reconcile.metrics import ReconcileMetrics
from controlplane.rests import RestBoard, RestPublisher
from controlplane.rollouts.controller import RolloutController
from controlplane.rollouts.signals import PlanResolver, SignalPublisher
from controlplane.rollouts.state import register_metrics as register_rollout_metrics
from controlplane.spend import (
    PlanContext,
    SavingsCollector,
    SpendCollector,
    SpendPublisher,
    fleet_spend,
)
from signals.overflowwork import SAMPLE_WINDOW
from xdsserver.arrivals import ArrivalBook
from xdsserver.difficultylog import ScoreBook
from xdsserver.identity import FleetBinding
from xdsserver.server import AdsServer
from xdsserver.signals import AccessLogServer, SignalBook
from xdsserver.snapshot import SnapshotCache
from xdsserver.status import ConnectionRegistry
from xdsserver.usage import UsageBook
from xdsserver.work import WorkBook

__all__ = ["ServeConfig", "add_arguments", "config_from_args", "run", "serve"]

log = logging.getLogger("kvpilot")


def run(
    args: argparse.Namespace, *, connection_registry: type[ConnectionRegistry] = ConnectionRegistry
) -> int:
    """Entry point of `kvpilot serve`. `connection_registry` is the class that records every
    ADS stream's events (the control-plane benchmark passes one that also logs each ACK)."""
    setup_logging(args.log_level)
    config = config_from_args(args)
    check_xds(config)
    try:
        _auth(config)
    except AuthConfigError as error:
        # Before anything starts (no embedded etcd): one line that says what to set.
        print(f"kvpilot serve: error: {error}", file=sys.stderr)
        return 2
    embedded: EmbeddedEtcd | None = None
    if not config.etcd_endpoints:
        embedded = EmbeddedEtcd(
            config.state_dir / "etcd", client_port=config.embedded_etcd_port or None
        )
        log.info(
            "no --etcd-endpoints given: starting an embedded etcd in %s", config.state_dir / "etcd"
        )
        embedded.start()
        config.etcd_endpoints = [embedded.endpoint]
        config.etcd_embedded = True
        # Printed, not only logged: `kvpilot agent --etcd-endpoints` needs this address.
        print(
            f"embedded etcd at {embedded.endpoint} (point agents at it with "
            f"--etcd-endpoints {embedded.endpoint})",
            flush=True,
        )
    try:
        asyncio.run(serve(config, connection_registry=connection_registry))
    except EtcdAccessDenied as error:
        log.error("%s", error)
        return 2
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


def _auth(config: ServeConfig) -> AuthConfig:
    """The REST API's tokens; AuthConfigError (with what to set) when there are none."""
    if config.insecure_no_auth:
        return AuthConfig.disabled()
    return AuthConfig.from_sources(config.tokens_file, os.environ)


async def _drive_rollouts(mirror: StateMirror, controller: RolloutController) -> None:
    """Drive rollouts once the mirror holds etcd's state (decisions read it)."""
    await mirror.wait_synced()
    await controller.run()


async def serve(
    config: ServeConfig,
    *,
    started: asyncio.Event | None = None,
    connection_registry: type[ConnectionRegistry] = ConnectionRegistry,
) -> None:
    """Run the daemon until SIGINT/SIGTERM (or cancellation)."""
    auth = _auth(config)
    registry = CollectorRegistry()
    cache = SnapshotCache(default_fleet=config.default_fleet, node_overrides=config.node_fleets)
    connections = connection_registry(registry=registry)
    reconciler = Reconciler(
        cache,
        quiet_period=config.quiet_period,
        max_wait=config.max_wait,
        min_push_interval=config.telemetry_push_interval,
        metrics=ReconcileMetrics(registry),
    )
    client = await open_client(
        config.etcd_endpoints, config.etcd_security, meanwhile="serving starts and keeps trying"
    )
    audit = AuditLog(client, config.prefix, retention=config.audit_retention)
    store = Store(client, config.prefix, on_write=audit.record)

    signals = SignalBook(PlanResolver(lambda: reconciler.plan))
    # Overflow skips a paid pool that answered 429 until its Retry-After has passed: a rest
    # learned by this replica's Envoys or by another replica's (through etcd).
    rests = RestBoard(signals.rests, config.replica_id)
    # Spill reads a fleet's arrival rate from every replica's Envoys: this replica's from
    # memory, the others' from etcd.
    # Service times come only from attempts that found a free batch slot on their host: the
    # slots are the agents' max_running (read from the last compile's telemetry).
    arrivals = ArrivalBook(slots=lambda: batch_slots(reconciler.state))
    shared_arrivals = ArrivalBoard(arrivals.rates, config.replica_id)
    # Overflow's prefill fits outlive this replica in etcd: a fresh fit continues from them.
    fits = FitBoard()
    mirror: StateMirror

    def on_change(change: StateChange) -> None:
        reconciler.on_change(change, mirror.items)
        rests.on_change(change, mirror.items)
        shared_arrivals.on_change(change, mirror.items)
        fits.on_change(change, mirror.items)

    mirror = StateMirror(client, config.prefix, on_change)
    Gauge(
        "kvpilot_etcd_watch_connected",
        "1 while this replica's etcd watch is established; 0 while etcd is unreachable (Envoys "
        "keep the last snapshot meanwhile).",
        registry=registry,
    ).set_function(lambda: float(mirror.connected))

    grpc_server = grpc.aio.server(
        options=[
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ]
    )
    xds_address = f"{config.xds_host}:{config.xds_port}"
    binding: FleetBinding | None = None
    if config.xds_tls is not None:
        binding = FleetBinding.parse(config.xds_identity_fleets)
        ads = AdsServer(cache, connections, binding=binding)
        xds_port = grpc_server.add_secure_port(xds_address, config.xds_tls.server_credentials())
    elif config.xds_insecure_plaintext:
        log.warning(
            "ADS is PLAINTEXT without client certificates (--xds-insecure-plaintext): any process "
            "that reaches %s can claim any fleet and read its routes and backend addresses",
            xds_address,
        )
        ads = AdsServer(cache, connections)
        xds_port = grpc_server.add_insecure_port(xds_address)
    else:
        raise ValueError("ServeConfig needs xds_tls or xds_insecure_plaintext=True")
    ads.add_to(grpc_server)
    scores = ScoreBook(registry)
    usage = UsageBook(PlanContext(lambda: reconciler.plan, lambda: reconciler.state))
    work = WorkBook()
    registry.register(SpendCollector(usage.ledger))
    registry.register(SavingsCollector(usage.ledger, lambda: reconciler.state))
    AccessLogServer(
        signals,
        cache,
        binding=binding,
        status=connections,
        scores=scores,
        usage=usage,
        arrivals=arrivals,
        work=work,
    ).add_to(grpc_server)
    # Spill reads each fleet's arrival rate and its locality's service times at every compile.
    reconciler.arrivals = shared_arrivals.rates
    arrival_publisher = ArrivalPublisher(store, arrivals.rates, config.replica_id)
    reconciler.service_times = arrivals.service_times
    reconciler.completions = arrivals.completions
    # Overflow by arrivals (signals.overflowff): capacity samples and the conversations' share.
    reconciler.recent_completions = lambda now: arrivals.completions(now, window=SAMPLE_WINDOW)
    reconciler.session_shares = arrivals.session_shares
    reconciler.recent_demands = arrivals.recent_demands
    # ... and in work, from the usage the responses carried (signals.overflowff).
    reconciler.recent_work = lambda now: work.host_work(now, window=SAMPLE_WINDOW)
    reconciler.completed_work = work.host_work
    reconciler.kind_work = work.kinds
    reconciler.prefill_per_output = work.prefill_per_output
    difficulty = DifficultyLoop(
        scores,
        lambda: virtual_models_of(reconciler.state.policies if reconciler.state else {}),
        reconciler.set_difficulty,
        registry=registry,
    )
    rest_publisher = RestPublisher(store, signals.rests, config.replica_id)
    reconciler.provider_backoff = rests.active
    reconciler.stored_fits = fits.fits
    signals.rests.listeners.append(reconciler.live_changed)
    signals.rests.listeners.append(rest_publisher.poke)
    rests.listeners.append(reconciler.live_changed)
    register_rollout_metrics(registry, lambda: mirror.items)

    app = create_app(
        ApiContext(
            store=store,
            reconciler=reconciler,
            connections=connections,
            auth=auth,
            metrics_registry=registry,
            replica_id=config.replica_id,
            envoy_records=lambda: envoy_records(mirror.items),
            mirror=mirror,
            etcd_embedded=config.etcd_embedded,
            etcd_watching=lambda: mirror.connected,
            audit=audit,
            write_limit=WriteRateLimit(config.write_rate, config.write_burst),
            cors_origins=config.cors_origins,
            virtual_model_counts=lambda: scores.totals,
            spend=lambda window, at: fleet_spend(
                mirror.items, usage.ledger, config.replica_id, window, at
            ),
        )
    )
    api = UvicornServer(
        uvicorn.Config(
            app, host=config.api_host, port=config.api_port, log_level="warning", lifespan="off"
        )
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    reloader: TokenReloader | None = None
    if config.tokens_file is not None and auth.enabled:
        reloader = TokenReloader(auth, config.tokens_file, os.environ)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, reloader.reload)

    await grpc_server.start()
    publisher = asyncio.create_task(
        StatusPublisher(store, connections, config.replica_id).run(), name="envoy-status"
    )
    rollouts = RolloutController(
        client,
        store.keys,
        lambda: mirror.items,
        config.replica_id,
        lease_ttl=config.rollout_lease_ttl,
    )
    # Spend records carry no lease: they outlive the replica, which writes its last batch
    # on the way out (below) and continues from them when started again.
    spend = asyncio.create_task(SpendPublisher(store, usage, config.replica_id).run(), name="spend")
    fit_writes = asyncio.create_task(
        FitPublisher(
            store,
            fits,
            lambda: reconciler.plan.overflow if reconciler.plan is not None else {},
            config.replica_id,
        ).run(),
        name="prefill-fits",
    )
    budgets = BudgetWatcher(reconciler, usage.ledger, lambda: mirror.items, config.replica_id)
    usage.listeners.append(budgets.poke)
    # Revokes its lease when cancelled: the other replicas stop counting this one's Envoys.
    arrival_rates = asyncio.create_task(arrival_publisher.run(), name="arrival-rates")
    tasks = [
        asyncio.create_task(mirror.run(), name="etcd-watch"),
        asyncio.create_task(budgets.run(), name="budgets"),
        asyncio.create_task(
            SignalPublisher(store, signals, config.replica_id).run(), name="signals"
        ),
        asyncio.create_task(_drive_rollouts(mirror, rollouts), name="rollouts"),
        spend,
        fit_writes,
        asyncio.create_task(rest_publisher.run(), name="provider-rests"),
        arrival_rates,
        asyncio.create_task(reconciler.run(), name="reconcile"),
        asyncio.create_task(difficulty.run(), name="virtual-model-shares"),
        asyncio.create_task(api.serve(), name="rest-api"),
        publisher,
    ]
    if reloader is not None:
        tasks.append(asyncio.create_task(reloader.watch(), name="tokens-reload"))
    log.info(
        "kvpilot replica %s: etcd %s, prefix %s",
        config.replica_id,
        ",".join(config.etcd_endpoints),
        config.prefix,
    )
    log.info(
        "ADS (gRPC, SotW and Delta, %s) listening on %s:%d",
        "mutual TLS" if config.xds_tls is not None else "plaintext",
        config.xds_host,
        xds_port,
    )
    log.info(
        "REST API listening on http://%s:%d (console at /ui, OpenAPI at /docs)",
        config.api_host,
        config.api_port,
    )
    if started is not None:
        started.set()
    try:
        done, _ = await asyncio.wait(
            [asyncio.create_task(stop.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED
        )
        for task in done:
            if task in tasks and task.exception() is not None:
                log.error("%s stopped: %r", task.get_name(), task.exception())
    finally:
        log.info("shutting down")
        api.should_exit = True
        ads.close()  # streams end with status OK instead of waiting out the grace
        await grpc_server.stop(grace=2.0)
        # The publisher revokes its lease on the way out, which removes this replica's Envoy
        # records from etcd at once instead of after the lease TTL: let it, while etcd is open.
        publisher.cancel()
        spend.cancel()
        fit_writes.cancel()
        arrival_rates.cancel()
        await asyncio.wait([publisher, spend, fit_writes, arrival_rates], timeout=3.0)
        for task in tasks:
            task.cancel()
        # Closing the channel ends an etcd watch that is still being opened; waiting for the
        # cancelled tasks first could wait for that call's own deadline.
        await client.close()
        await asyncio.gather(*tasks, return_exceptions=True)
