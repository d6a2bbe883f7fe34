"""The running server's live reload: the config file read again and applied, or refused.

`Reloader.reload` runs one reload at a time (SIGHUP, or the admin RPC through
`reload_for`): what to check and what needs a restart is cacheserver.reload's; this
module applies a checked file to the running parts in an order that never serves a
mix of the two configs to a principal the new one cuts off:

1. the policy takes the new access rules (each principal's next request is judged by
   its new entry: policy.access.AccessPolicy.current);
2. what the old rules opened for a principal cut off is closed: its tickets, its gRPC
   calls in flight, its bulk connections on every path; `[limits]` hold from each
   transport's next request (the request core's), and bulk workers get the config's
   limits, public scope and rate slots for the connections they already serve;
3. new TLS handshakes use the new certificate, key and client CA;
4. quotas: a tenant over a lowered one leaves the index and memory at once; what is no
   longer served (those blocks, a removed tenant's) leaves the disk behind the reload,
   on a task `finish` waits for, since a delete waits for the disk writer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from cacheserver.config import ServerConfig, TlsFiles
from cacheserver.core.requests import RequestCore
from cacheserver.reload import (
    ConfigSource,
    ReloadOutcome,
    ReloadState,
    check_live,
    describe,
    require_admin,
)
from cacheserver.startup import check_tls
from cacheserver.store import BlockStore
from cacheserver.transport.bulk import BulkServer
from cacheserver.transport.bulk.readworkers import WorkerAssembly
from cacheserver.transport.grpc.credentials import RotatingCertificate, bulk_tls, read_tls
from cacheserver.transport.grpc.open_calls import OpenCalls
from kvcommon.errors import ConfigError, KvshareError
from policy import AccessPolicy, Principal
from policy.tickets import TicketBook
from policy.types import TenantId

log = logging.getLogger(__name__)


class Reloader:
    def __init__(
        self,
        source: ConfigSource | None,
        config: ServerConfig,
        tls: TlsFiles | None,
        certificate: RotatingCertificate | None,
        policy: AccessPolicy,
        store: BlockStore,
        tickets: TicketBook,
    ) -> None:
        """`source`: the file (and flags) to read again; None: every reload is refused
        (dev mode, a config built in code). `config`, `tls`: what serves now."""
        self.source = source
        self.config = config
        self._tls = tls
        self._certificate = certificate
        self._policy = policy
        self._store = store
        self._tickets = tickets
        self._calls: OpenCalls | None = None
        self._bulk: BulkServer | None = None
        self._core: RequestCore | None = None
        self._workers: WorkerAssembly | None = None
        self.state = ReloadState()
        self._lock = asyncio.Lock()
        self._cleanups: set[asyncio.Task[None]] = set()  # a reload's deletes, running

    def attach(
        self,
        calls: OpenCalls,
        bulk: BulkServer | None,
        core: RequestCore | None = None,
        workers: WorkerAssembly | None = None,
    ) -> None:
        """The started server's gRPC calls in flight, bulk listener, request core (every
        transport's: its limits) and bulk workers."""
        self._calls, self._bulk = calls, bulk
        self._core, self._workers = core, workers

    async def reload_for(self, principal: Principal) -> ReloadOutcome:
        """The admin RPC Reload: an `admin` principal's reload (PermissionDenied else)."""
        self._policy.check_rate(principal)
        is_admin = self._policy.is_admin(principal)
        if not is_admin:
            self._policy.audit.record("denied", principal=principal.name, action="reload")
        require_admin(is_admin, principal)
        return await self.reload(principal.name)

    async def reload(self, by: str | None = None) -> ReloadOutcome:
        """Read the config file again and apply it live, or refuse all of it (one line
        naming what to change). `by`: the admin principal that asked (None: SIGHUP)."""
        async with self._lock:
            try:
                message = self._apply()
                ok = True
            except ConfigError as error:
                message, ok = str(error), False
            self.state.note(ok, message)
            generation = self.state.generation
            self._policy.audit.record(
                "reload", principal=by, applied=ok, generation=generation, detail=message
            )
            if ok:
                log.info("config reloaded (generation %d): %s", generation, message)
            else:
                log.error("config reload refused, the running config stays: %s", message)
            return ReloadOutcome(ok, message, generation)

    def _apply(self) -> str:
        """Check the file whole, then apply it (the module docstring's order); what
        changed, in one line. ConfigError: refused, nothing applied."""
        if self.source is None:
            raise ConfigError(
                "this server was started without a config file (dev mode): nothing to "
                "reload; start it with --config FILE"
            )
        config, tls, text = self.source.load()
        check_live(self.config, config, text)
        check_tls(config, tls)
        try:
            material = read_tls(tls) if tls is not None else None
            bulk_context = bulk_tls(material)  # a bad certificate or key is refused here
        except ConfigError as error:  # named where the file points at them: [tls]
            raise text.error(("tls",), str(error)) from None
        assert config.access is not None
        change = self._policy.reload_access(
            config.access,
            requests_per_s=config.limits.requests_per_s,
            burst_s=config.limits.request_burst_s,
        )
        cut = change.closed
        tickets = self._tickets.revoke(cut)
        ended = self._calls.end(cut) if self._calls is not None else 0
        closed = self._bulk.close_principals(cut) if self._bulk is not None else 0
        for name, reason in cut.items():
            self._policy.audit.record("revoked", principal=name, reason=reason)
        if self._core is not None:
            self._core.set_limits(config.limits)
        if self._workers is not None:  # the generation this reload makes
            self._workers.update(self.state.generation + 1, config)
        if material is not None and self._certificate is not None:
            self._certificate.rotate(material)
            if self._bulk is not None and bulk_context is not None:
                self._bulk.use_tls(bulk_context)
        self._tls, self.config = tls, config
        evicted = self._store.set_quotas(self._policy.quotas_bytes)
        if evicted:
            self._in_background("evict_to_lowered_quotas", self._store.delete, evicted)
        for tenant in change.tenants_removed:
            self._in_background(
                "reclaim_removed_tenant", self._store.delete_tenant, tenant, tenant=tenant
            )
        return describe(change, ended, closed, tickets) + (
            f"; evicted to lowered quotas {len(evicted)}" if evicted else ""
        )

    def _in_background(
        self, action: str, delete: Callable[..., int], *args: Any, tenant: TenantId | None = None
    ) -> None:
        """Run a reload's delete on a thread; audit it when done."""

        async def run() -> None:
            try:
                blocks = await asyncio.to_thread(delete, *args)
            except KvshareError as error:  # the writer is behind: a restart reclaims them
                log.warning("%s after a reload: %s", action, error)
                return
            self._policy.record_admin(None, action, tenant=tenant, blocks=blocks)

        task = asyncio.get_running_loop().create_task(run())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def finish(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the deletes reloads left running."""
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=timeout_s)
