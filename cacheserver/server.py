"""Assemble and run the server: data dir, policy, store, gRPC services.

Start-up fails fast with one line naming what to change (unwritable data dir, data dir
in use, port in use, non-loopback listen without TLS). Shutdown (SIGTERM/SIGINT)
stops accepting RPCs, lets in-flight ones finish within a grace period, then drains the
writer and closes LMDB cleanly. SIGHUP (or the admin RPC Reload) reads the config file
again and applies it live, or refuses all of it (cacheserver.reload).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cacheserver.config import ServerConfig, StorageConfig, TlsFiles
from cacheserver.config.bulk import (
    bulk_announced_address,
    bulk_listen_address,
)
from cacheserver.config.specs import GRPC_SLACK_BYTES
from cacheserver.core.requests import RequestCore
from cacheserver.core.values import BulkEndpoint
from cacheserver.events import FanOut, TenantCounters
from cacheserver.health import HealthMonitor
from cacheserver.reload import ConfigSource, ReloadOutcome
from cacheserver.reloader import Reloader
from cacheserver.startup import check_can_bind, check_tls, prepare_data_dir
from cacheserver.store import BlockStore
from cacheserver.telemetry import ServerTelemetry
from cacheserver.tiers.assembly import HealthWatch, open_tiers
from cacheserver.transport.bulk import BulkServer
from cacheserver.transport.bulk.readworkers import WorkerAssembly
from cacheserver.transport.grpc.credentials import RotatingCertificate, bulk_tls, read_tls
from cacheserver.transport.grpc.service import BlockStoreService
from cacheserver.transport.grpc.wire import AuthInterceptor
from kvcommon.errors import ConfigError
from kvcommon.v1 import kvshare_pb2, kvshare_pb2_grpc
from policy import AccessPolicy
from policy.audit import AuditLog
from policy.devmode import dev_access
from policy.naming import load_or_create_server_secret
from policy.ratelimit import RequestRateLimiter, SharedBuckets
from policy.tickets import Grant, TicketBook
from policy.types import PUBLIC, TenantId

log = logging.getLogger(__name__)
SERVICE_NAME = kvshare_pb2.DESCRIPTOR.services_by_name["BlockStore"].full_name
SHUTDOWN_GRACE_S = 10.0
# With bulk workers: how long a journaled put may wait to reach LMDB under load. Short
# enough that workers soon serve a block put a moment ago (until then it is a hand-back),
# long enough that one LMDB commit takes many puts.
WORKERS_DRAIN_WITHIN_S = 0.02
BULK_HEALTH_SERVICE = "kvshare.bulk"  # SERVING while the bulk listeners can accept

__all__ = ["Server", "TlsFiles", "serve"]


class Server:
    def __init__(
        self,
        config: ServerConfig,
        tls: TlsFiles | None = None,
        telemetry: ServerTelemetry | None = None,
        source: ConfigSource | None = None,
    ) -> None:
        """`telemetry`: instruments and exporters; by default built from config.telemetry.
        `source`: the config file (and flags) a live reload reads again; None: a reload
        is refused (dev mode, or a config built in code)."""
        tls = tls or config.tls
        check_tls(config, tls)
        self.config = config
        self._tls = tls
        self._tls_material = read_tls(tls) if tls is not None else None
        self._certificate = (
            RotatingCertificate(self._tls_material) if self._tls_material is not None else None
        )
        self.telemetry = telemetry or ServerTelemetry(config.telemetry)
        self._lock_file = prepare_data_dir(config.data_dir)
        access = config.access or dev_access(config.data_dir)
        self.audit = AuditLog(config.audit_log_path)
        # With bulk workers, every process draws a principal's requests from one bucket.
        processes = config.bulk.processes()  # by the host's cores when not configured
        shared = None
        if processes > 1:
            shared = SharedBuckets([principal.name for principal in access.principals()])
        limiter = RequestRateLimiter(
            config.limits.requests_per_s, config.limits.request_burst_s, shared=shared
        )
        self.policy = AccessPolicy.from_access(
            access,
            load_or_create_server_secret(config.secret_path),
            limiter=limiter,
            audit=self.audit,
            accept_certificates=tls is not None and tls.client_ca is not None,
        )
        epochs = access.epochs()
        self.counters = TenantCounters()  # the Stats RPC's figures, from the same events
        # The tiers behind LMDB its config names; what each declares decides its health
        # service, its metrics and whether reads may wait on it (cacheserver.tiers.assembly).
        self.tier_stack = open_tiers(config, self.policy)
        self.store = BlockStore(
            config.data_dir,
            config.storage,
            self.policy.quotas_bytes,
            epochs,
            on_integrity_failure=self.policy.record_integrity_failure,
            events=FanOut(self.telemetry, self.counters),
            lower_tiers=self.tier_stack.behind,
            fixed_order=frozenset({PUBLIC}) if access.public is not None else frozenset(),
            drain_within_s=_drain_within_s(config, processes),
        )
        self.telemetry.gauges.watch(self.store.tier_usage, self._tenant_usage)
        self.telemetry.gauges.watch_backlog(
            self.store.journal_usage,
            self.store.writer_backlog,
            lambda: sorted(self.policy.quotas_bytes),
        )
        self.tickets = TicketBook()
        # The config file read again on SIGHUP and the admin RPC (cacheserver.reloader).
        self.reloader = Reloader(
            source, config, tls, self._certificate, self.policy, self.store, self.tickets
        )
        state = self.reloader.state
        self.telemetry.gauges.watch_reloads(
            lambda: (state.generation, state.last_at_s, state.last_ok)
        )
        if self.store.reclaimed_at_start:
            self.policy.record_admin(
                None, "reclaim_retired_epochs", blocks=self.store.reclaimed_at_start
            )
        self.health = health.aio.HealthServicer()
        self.health_monitor = HealthMonitor(
            self.health,
            ("", SERVICE_NAME),
            self.store.probe,
            config.telemetry.health_interval_ms / 1000,
            on_change=lambda serving: setattr(self.telemetry.gauges, "serving", serving),
        )
        self.bulk_health: HealthMonitor | None = None
        for tier in self.tier_stack.shared:  # the store started it (Tier.start)
            self.telemetry.gauges.watch_cluster(tier.counts)
        # A tier the server serves without has a health service of its own
        # (Capability.OWN_HEALTH): the local tiers keep serving while it is unreachable.
        self.tier_health = [self._watch_tier(watch) for watch in self.tier_stack.health]
        self.workers: WorkerAssembly | None = None
        if processes > 1:
            self.workers = WorkerAssembly(
                processes, config, self.policy, limiter, self.store, self.telemetry
            )
        self.bulk: BulkServer | None = None
        self._service: BlockStoreService | None = None
        self.bulk_announced = ""  # what OpenBulk tells clients (bulk_announced_address)
        self._server: grpc.aio.Server | None = None
        self.address = ""
        self.metrics_address = ""

    def _watch_tier(self, watch: HealthWatch) -> HealthMonitor:
        def on_change(up: bool) -> None:
            if watch.is_shared:
                self.telemetry.gauges.cluster_reachable = up

        return HealthMonitor(
            self.health,
            (watch.service,),
            watch.tier.probe,
            self.config.telemetry.health_interval_ms / 1000,
            on_change=on_change,
        )

    def _tenant_usage(self) -> dict[TenantId, tuple[int, int]]:
        quotas = self.policy.quotas_bytes
        return {t: (self.store.tenant_usage(t)[1], quotas[t]) for t in sorted(quotas)}

    async def start(self) -> str:
        """Listen and serve; the address. A start that fails (the port in use, say)
        lets go of what the server holds before it raises (`stop`): the store's threads,
        its journal and LMDB, the data dir's lock. Left running, the threads outlived
        the error into the interpreter's exit (after `kvshare serve`'s one-line error)."""
        try:
            return await self._start()
        except BaseException:
            try:
                await self.stop(grace_s=0)
            except Exception:  # the start's own error is the one to report
                log.exception("releasing what a failed start held failed")
            raise

    async def _start(self) -> str:
        max_message = self.config.limits.max_message_bytes + GRPC_SLACK_BYTES
        self._interceptor = AuthInterceptor(self.policy, self.telemetry)
        server = grpc.aio.server(
            interceptors=[self._interceptor],
            options=[
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", max_message),
                ("grpc.so_reuseport", 0),
            ],
        )
        host = self.config.listen.rsplit(":", 1)[0]
        check_can_bind(self.config.listen)  # first: a second server's error names --listen
        bulk_listen = bulk_listen_address(self.config)
        core = RequestCore(
            self.store,
            self.policy,
            self.config.limits,
            self.counters,
            receive_bytes=self.config.storage.max_pending_write_bytes,
        )
        self.bulk = bulk = BulkServer(
            bulk_listen.bracketed_host,
            core,
            self.tickets,
            bulk_tls(self._tls_material),
            telemetry=self.telemetry,
            bulk=self.config.bulk,
            port=bulk_listen.port,
            delegate_to=self._delegate if self.workers is not None else None,
            # A read through to a shared tier waits on the network: not on the ready loop.
            ready_loop=not self.tier_stack.reads_wait_on_network,
        )
        self.bulk_announced = bulk_announced_address(self.config, bulk.address)
        self.telemetry.gauges.watch_bulk(lambda: bulk.arenas)
        # A listener out of descriptors keeps retrying; its state has a health service
        # of its own, as the cluster's has: gRPC still serves meanwhile.
        self.bulk_health = HealthMonitor(
            self.health,
            (BULK_HEALTH_SERVICE,),
            bulk.problem,
            self.config.telemetry.health_interval_ms / 1000,
        )
        bulk.start()
        if self.workers is not None:
            self.workers.start()
        core.bulk = BulkEndpoint(
            self.tickets,
            self.bulk_announced,
            bulk.local_address,
            bulk.local_namespace,
            bulk.local_uid,
        )
        self.reloader.attach(self._interceptor.calls, bulk, core, self.workers)
        self._service = BlockStoreService(core, self.config.limits, reload=self.reloader.reload_for)
        kvshare_pb2_grpc.add_BlockStoreServicer_to_server(self._service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        port = self._bind(server)
        self.metrics_address = self.telemetry.start()
        await server.start()
        self._server = server  # from here on, `stop` stops it
        await self.health_monitor.start()
        for monitor in self.tier_health:
            await monitor.start()
        await self.bulk_health.start()
        self.address = f"{host}:{port}"
        return self.address

    def _bind(self, server: grpc.aio.Server) -> int:
        check_can_bind(self.config.listen)
        try:
            if self._certificate is None:
                port = server.add_insecure_port(self.config.listen)
            else:
                port = server.add_secure_port(self.config.listen, self._certificate.credentials())
        except RuntimeError:
            port = 0
        if port == 0:
            raise ConfigError(
                f"cannot listen on {self.config.listen}: the port is in use or the "
                "address is not on this host; pick another --listen"
            )
        return port

    def _delegate(
        self, raw: socket.socket, grant: Grant, to_a_worker: bool
    ) -> socket.socket | None:
        """Hand a connection to a bulk worker, which serves reads on its own, only while
        its principal is as it was authenticated (not cut off by a reload meanwhile);
        else the server serves it, and the policy refuses its next request."""
        if self.workers is None or not self.policy.is_current(grant.principal):
            return None
        return self.workers.delegate(raw, grant, to_a_worker)

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        await self.health_monitor.stop()
        for monitor in self.tier_health:
            await monitor.stop()
        if self.bulk_health is not None:
            await self.bulk_health.stop()
        await self.health.enter_graceful_shutdown()  # probes see NOT_SERVING while draining
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self.bulk is not None:
            self.bulk.stop()
            self.bulk = None
        if self.workers is not None:
            self.workers.stop()
        await self.reloader.finish(SHUTDOWN_GRACE_S)
        if self._service is not None:
            self._service.close()
            self._service = None
        self.store.close()  # stops the tiers' threads (a shared tier's) first
        self.telemetry.shutdown()
        self.audit.close()
        self._lock_file.close()


def _drain_within_s(config: ServerConfig, processes: int) -> float | None:
    """With bulk workers, which read only LMDB, a journaled put moves into LMDB within
    WORKERS_DRAIN_WITHIN_S even while requests never pause, as long as workers hand
    reads back (a busy server would otherwise keep new blocks where only it can serve
    them; Writer.reads_handed_back), unless drain_idle_ms is set to another value than
    its default."""
    default = StorageConfig.drain_idle_ms
    if processes > 1 and config.storage.drain_idle_ms == default:
        return WORKERS_DRAIN_WITHIN_S
    return None


async def serve(
    config: ServerConfig, tls: TlsFiles | None = None, source: ConfigSource | None = None
) -> None:
    """Run until SIGTERM or SIGINT; print `serving on HOST:PORT` when ready. SIGHUP
    reloads the config from `source` (cacheserver.reload)."""
    server = Server(config, tls, source=source)
    # What start-up built lives as long as the process (the index of every stored
    # block, rebuilt from LMDB): kept out of the collector's full passes, which walk
    # every tracked object with the GIL held and every request waiting (800,000
    # indexed blocks: ~150 ms a pass; frozen, 3 ms for 50,000 blocks put since).
    # Before the listeners open, so no request waits for this one pass; not in Server:
    # a server embedded in another program leaves its heap alone.
    gc.collect()
    gc.freeze()
    address = await server.start()
    mode = (
        " (dev mode: tenant 'dev', token in " + str(config.data_dir / "dev.token") + ")"
        if config.is_dev_mode
        else ""
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before "serving on": a signal right
        loop.add_signal_handler(sig, stopping.set)  # after it must drain, not kill
    reloading: set[asyncio.Task[ReloadOutcome]] = set()

    def reload_on_hangup() -> None:  # SIGHUP's default action would kill the server
        task = loop.create_task(server.reloader.reload())
        reloading.add(task)
        task.add_done_callback(reloading.discard)

    loop.add_signal_handler(signal.SIGHUP, reload_on_hangup)
    if server.metrics_address:
        print(f"kvshare metrics on {server.metrics_address} (/metrics)", flush=True)
    print(f"kvshare serving on {address}{mode}", flush=True)
    if server.bulk is not None:
        print(
            f"kvshare bulk on {server.bulk.address} (announced: {server.bulk_announced})",
            flush=True,
        )
    await stopping.wait()
    log.info("draining in-flight RPCs (grace %.0f s)", SHUTDOWN_GRACE_S)
    await server.stop()
    print("kvshare stopped cleanly", flush=True)
