"""The server's side of its bulk read workers: what a worker is delegated with a
connection (data, `delegation_for`), what a worker's report changes here, and how many
LMDB readers the server and its workers may hold at once. `readworker` is one worker
(its process), `processes` starts, restarts and hands connections to them, and
`delegation` frames what crosses between the two sides."""

from __future__ import annotations

import socket

from cacheserver.config import ServerConfig
from cacheserver.core.readonly import Defaults, Grants, check_reader_table
from cacheserver.core.served import ServingStore, TenantReport, replay
from cacheserver.telemetry import ServerTelemetry
from cacheserver.transport.bulk.delegation import Delegation, Update
from cacheserver.transport.bulk.handler import OPS
from cacheserver.transport.bulk.listener import IDLE_TIMEOUT_S
from cacheserver.transport.bulk.processes import WorkerProcesses, WorkerSpec
from cacheserver.transport.bulk.slots import MAX_AUTHENTICATED
from cacheserver.transport.grpc.threads import THREADS
from kvcommon import bulkwire
from policy import AccessPolicy
from policy.ratelimit import RequestRateLimiter
from policy.tickets import Grant
from policy.types import TenantId

# The methods of the bulk channel's calls, as the listener names them.
BULK_GET = f"kvshare.bulk/{OPS[bulkwire.OP_GET]}"
BULK_LOOKUP = f"kvshare.bulk/{OPS[bulkwire.OP_LOOKUP]}"

# Threads of the server's own, besides the bulk channel's and gRPC's pools, that may
# hold a read transaction: the asyncio default executor's (at most 32: the health
# probes, whose own LMDB work is a write), the store's writer, the tiers' threads (a
# shared tier's copies of local blocks, few), and the start-up scan. Generous: a slot
# costs 64 bytes of the lock file, and LMDB scans only the slots ever used.
SERVER_OWN_READERS = 64


def lmdb_readers_needed(config: ServerConfig) -> int:
    """The most LMDB read transactions the server and its bulk workers can hold at once
    (cacheserver.tiers.lmdb sizes the reader table above it, MAX_READERS):

    - every authenticated bulk connection (TCP, TLS, sealed or same-host: one cap for
      all, `MAX_AUTHENTICATED`) is served by one thread at a time, in one process (a
      worker waits, with no transaction open, while the server serves what it handed
      back), and that thread holds at most one read transaction, never while it waits
      on the peer: one each;
    - gRPC's read and write pools (`THREADS` each): one each;
    - the server's other threads (SERVER_OWN_READERS);
    - each process (the server and every worker) keeps one spare read transaction,
      and with it a slot, for its next read (py-lmdb's).
    """
    return MAX_AUTHENTICATED + 2 * THREADS + SERVER_OWN_READERS + config.bulk.processes()


def delegation_for(
    grant: Grant,
    policy: AccessPolicy,
    limiter: RequestRateLimiter,
    config: ServerConfig,
    generation: int = 0,
) -> Delegation:
    """What a worker gets with a connection: data, not decisions. The grant's principal
    as the config has it, its tenant and that tenant's naming key, the limits and the
    public scope (of config generation `generation`); the worker decides from them with
    the request core's own admission (cacheserver.core.readonly)."""
    grants = Grants(
        principal=grant.principal,
        tenant=grant.tenant,
        naming_key=policy.tenant_namer(grant.tenant).naming_key,
        public=policy.public_scope,
        default_requests_per_s=limiter.default_requests_per_s,
        burst_s=limiter.burst_s,
        max_digests_per_call=config.limits.max_digests_per_call,
        generation=generation,
    )
    return Delegation.of(grants, IDLE_TIMEOUT_S, config.bulk.min_transfer_bytes_per_s)


class WorkerAssembly:
    """Starts the workers (`processes` - 1 of them), hands them connections, applies
    their reports, and tells them what a live reload changed (`update`)."""

    def __init__(
        self,
        processes: int,
        config: ServerConfig,
        policy: AccessPolicy,
        limiter: RequestRateLimiter,
        store: ServingStore,
        telemetry: ServerTelemetry,
    ) -> None:
        assert limiter.shared is not None, "workers draw from the server's shared buckets"
        check_reader_table(lmdb_readers_needed(config), processes)
        # The config delegations are made from, and its generation (one pair: a
        # reload replaces it whole).
        self._serving: tuple[int, ServerConfig] = (1, config)
        self._policy = policy
        self._limiter = limiter
        self._store = store
        self._telemetry = telemetry
        spec = WorkerSpec(
            store.lmdb_path,
            config.storage.effective_map_bytes(),
            limiter.shared,
            config.telemetry.log_format,
        )
        self.processes = WorkerProcesses(processes, spec, self.apply_report)

    def start(self) -> None:
        self.processes.start()

    def stop(self) -> None:
        self.processes.stop()

    def delegate(
        self, conn: socket.socket, grant: Grant, to_a_worker: bool = False
    ) -> socket.socket | None:
        """BulkServer's `delegate_to`: the connection to the next worker in turn (or, with
        `to_a_worker`, skipping the server's own), or None."""
        generation, config = self._serving
        delegation = delegation_for(grant, self._policy, self._limiter, config, generation)
        return self.processes.delegate(conn, delegation, to_a_worker)

    def update(self, generation: int, config: ServerConfig) -> int:
        """After a live reload to `config` (generation `generation`; the policy and the
        rate limiter have taken it already): the principals it adds get slots in the
        shared rate table, and every worker gets the new table and the config's public
        scope and limits, which the next request on each of its connections is admitted
        with (delegated before the reload or after). How many workers were told."""
        assert config.access is not None and self._limiter.shared is not None
        slots = self._limiter.shared.assign(p.name for p in config.access.principals())
        self._serving = (generation, config)
        defaults = Defaults(
            generation,
            self._policy.public_scope,
            self._limiter.default_requests_per_s,
            self._limiter.burst_s,
            config.limits.max_digests_per_call,
        )
        return self.processes.update(Update(defaults, slots))

    def apply_report(self, tenant: TenantId, report: TenantReport) -> None:
        """What a worker served: recently used in the index, the store events its reads
        fired replayed into the server's (its metrics and Stats count them as they count
        the server's own reads), and its calls in the bulk channel's call counts."""
        replay(self._store, tenant, report)
        self._telemetry.rpcs_served_elsewhere(BULK_LOOKUP, report.lookups)
        self._telemetry.rpcs_served_elsewhere(BULK_GET, report.gets)
