"""The request core as a bulk read worker runs it, in a process of its own
(cacheserver.transport.bulk.readworker frames for it).

A worker holds no audit log, store, index, put journal or server secret. With each
connection the server delegates data, not decisions (`Grants`): the principal as its
config has it (tenants, actions, rate), the connection's tenant and that tenant's
naming key, the limits, and the public scope. The last three (`Defaults`) are the
config's, not the connection's: the worker keeps one copy for all its connections and
takes a newer generation's whenever the server sends one (a live reload's update, or
a later delegation), so a reload changes them on connections delegated before it.
From them the worker builds a policy (`DelegatedPolicy`) and runs the core's own
admission with it (`RequestChecks`: rate,
tenant and action, digest count, model and digests, naming; the permission rule is
policy.permissions', the server's), reads LMDB through the tier's read-only view (the
same records and verification: cacheserver.tiers.lmdb), and counts what it served in
the store's own events (`ServedEvents`: looked_up, served, got), which the server
replays into its metrics and Stats.

It answers only what it can answer exactly as the server would: a LOOKUP or GET whose
every block is committed in LMDB, for the connection's tenant, in one read transaction.
A miss is None from `lookup` or `get`; a refusal is the KvshareError admission raised
(ResourceExhausted only from the rate, whose request was then not drawn: the server
draws and refuses it, and audits the episode). The worker hands both back, and the
server answers them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cacheserver.config import LimitsConfig
from cacheserver.core.checks import LiveLimits, RequestChecks
from cacheserver.core.values import Begun, Verb
from cacheserver.events import StoreEvents
from cacheserver.tiers.lmdb.environment import MAX_READERS
from cacheserver.tiers.lmdb.reader import BlockReads, LmdbReader
from kvcommon.errors import ConfigError, PermissionDenied, ResourceExhausted, Unavailable
from policy import Action, Principal, permissions
from policy.naming import TenantNamer
from policy.permissions import PublicScope
from policy.ratelimit import RequestRateLimiter, SharedBuckets
from policy.types import BlockDigest, ModelName, StorageKey, TenantId

# Raised only to hand a request back: the server answers it with its own message.
_HANDED_BACK = "handed back to the server"


@dataclass(frozen=True)
class Grants:
    """What the server delegates with a connection: data its policy decides from."""

    principal: Principal  # as the config has it: tenants, actions, requests_per_s
    tenant: TenantId  # the connection's (its ticket's)
    naming_key: bytes = field(repr=False)  # the tenant's alone (policy.naming.TenantNamer)
    public: PublicScope
    default_requests_per_s: int  # [limits]: for a principal with no rate of its own
    burst_s: int
    max_digests_per_call: int
    generation: int = 0  # the config generation of the four above (Defaults)

    def defaults(self) -> Defaults:
        return Defaults(
            self.generation,
            self.public,
            self.default_requests_per_s,
            self.burst_s,
            self.max_digests_per_call,
        )


@dataclass(frozen=True)
class Defaults:
    """The config's part of a delegation, the same for every connection: the public
    scope and `[limits]`, of config generation `generation` (a newer one replaces them)."""

    generation: int
    public: PublicScope
    default_requests_per_s: int
    burst_s: int
    max_digests_per_call: int


class WorkerDefaults:
    """A worker's one copy of `Defaults`, read by each of its connections' requests: the
    public scope, the rate limiter (its default rate and burst) and the limits."""

    def __init__(self, buckets: SharedBuckets) -> None:
        self.generation = -1  # none taken yet
        self.public = PublicScope(configured=False, reader_tenants=frozenset())
        self.limiter = RequestRateLimiter(0, shared=buckets)
        self.limits = LiveLimits(LimitsConfig())
        self._lock = threading.Lock()

    def take(self, defaults: Defaults) -> bool:
        """Use `defaults` if they are newer than those in use; whether they were."""
        with self._lock:
            if defaults.generation <= self.generation:
                return False
            self.limiter.set_defaults(defaults.default_requests_per_s, defaults.burst_s)
            self.limits.current = LimitsConfig(max_digests_per_call=defaults.max_digests_per_call)
            self.public = defaults.public
            self.generation = defaults.generation
            return True


class ServedEvents(StoreEvents, Protocol):
    """Where a worker counts what it served: the store's events, and the keys read (they
    become recently used in the server's index)."""

    def used(self, tenant: TenantId, keys: Sequence[StorageKey]) -> None: ...


class DelegatedPolicy:
    """A `RequestPolicy` from a connection's `Grants`: the rate drawn from the buckets
    every process shares, the permission rule the server's policy applies, and the
    tenant's names. Refusals are not audited here (the server audits them when it
    answers the request handed back)."""

    def __init__(self, grants: Grants, defaults: WorkerDefaults) -> None:
        self._defaults = defaults  # the worker's: public scope, rate defaults
        self._namer = TenantNamer(grants.tenant, grants.naming_key)

    def check_rate(self, principal: Principal) -> None:
        # A refusal is not noted in the shared bucket: the server's draw notes (and
        # audits) the episode's first.
        if not self._defaults.limiter.try_admit(principal):
            raise ResourceExhausted(_HANDED_BACK)

    def admit(self, principal: Principal, tenant: str, action: Action) -> TenantId:
        checked = permissions.tenant_id(principal, tenant)
        if not permissions.allows(principal, checked, action, self._defaults.public):
            raise PermissionDenied(_HANDED_BACK)
        return checked

    def storage_keys(
        self, tenant: TenantId, model: ModelName, digests: Sequence[BlockDigest]
    ) -> list[StorageKey]:
        if tenant != self._namer.tenant:  # it holds no other tenant's naming key
            raise PermissionDenied(_HANDED_BACK)
        return self._namer.storage_keys(model, digests)


def check_reader_table(readers_needed: int, processes: int) -> None:
    """LMDB's reader table (every process's read transactions: the server's and its
    read workers') holds `readers_needed` at once, or ConfigError saying what to lower
    (never at the specs' maxima: tests/unit/cacheserver/tiers/lmdb/test_lmdb_readers.py)."""
    if readers_needed > MAX_READERS:
        raise ConfigError(
            f"{processes} bulk-serving processes may hold {readers_needed} LMDB read "
            f"transactions at once, over its {MAX_READERS} reader slots; lower "
            "[bulk] workers"
        )


class ReadOnlyCore:
    """A read worker's process: LMDB's read-only view, the shared rate buckets, and
    where what it serves is counted."""

    def __init__(
        self, lmdb_path: Path, map_bytes: int, buckets: SharedBuckets, served: ServedEvents
    ) -> None:
        self._reader = LmdbReader(lmdb_path, map_bytes)
        self._buckets = buckets
        self._served = served
        self.defaults = WorkerDefaults(buckets)

    def close(self) -> None:
        self._reader.close()

    def update(self, defaults: Defaults, slots: dict[str, int] | None = None) -> bool:
        """The server's update after a live reload: the config's defaults for every
        connection (if newer than those in use: a delegation made after the reload may
        have brought them first), and the shared rate table's slots (`slots`: the whole
        table, replacing the one in use; only updates carry it, in reload order)."""
        taken = self.defaults.take(defaults)
        if slots is not None and defaults.generation >= self.defaults.generation:
            self._buckets.slots = dict(slots)
        return taken

    def bind(self, grants: Grants) -> BoundCore:
        """The core for one delegated connection (its grants' defaults taken, if newer)."""
        self.defaults.take(grants.defaults())
        checks = RequestChecks(DelegatedPolicy(grants, self.defaults), self.defaults.limits)
        return BoundCore(grants.principal, grants.tenant, checks, self._reader, self._served)


class BoundCore:
    """The verbs a worker answers for one connection's principal and tenant."""

    def __init__(
        self,
        principal: Principal,
        tenant: TenantId,
        checks: RequestChecks,
        reader: LmdbReader,
        served: ServedEvents,
    ) -> None:
        self._principal = principal
        self._tenant = tenant
        self._checks = checks
        self._reader = reader
        self._served = served

    def begin(self, verb: Verb, count: int) -> Begun:
        """Admission's first stage for the connection's principal and tenant (raises as
        the server's would: see the module's docstring)."""
        return self._checks.begin(self._principal, verb, self._tenant, count)

    def lookup(self, begun: Begun, model: str, digests: Sequence[bytes]) -> int | None:
        """How many blocks are present, when all are; None: not all (hand it back)."""
        assert begun.verb is Verb.LOOKUP
        keys = self._names(begun, model, digests)
        if keys is None:
            return None
        try:
            with self._reader.reads() as reads:
                if reads.leading_present(keys) < len(keys):
                    return None
        except Unavailable:
            return None  # LMDB's reader table is full: the server answers
        self._served.looked_up(begun.tenant, len(keys), len(keys))
        self._served.used(begun.tenant, keys)
        return len(keys)

    def get(
        self, begun: Begun, model: str, digests: Sequence[bytes], max_bytes: int
    ) -> WholeGet | None:
        """Every block of a GET, verified, as views into one read transaction (`with`
        it: they are valid until it ends); None: not all are there, or together they
        come to more than `max_bytes`, or LMDB's reader table is full (hand it back)."""
        assert begun.verb is Verb.GET
        keys = self._names(begun, model, digests)
        if keys is None:
            return None
        try:
            reads = self._reader.reads()
        except Unavailable:
            return None
        try:
            views = reads.leading(begun.tenant, keys, max_bytes)
        except BaseException:
            reads.__exit__(None, None, None)  # the transaction ends either way
            raise
        if views is None or len(views) < len(keys):
            reads.__exit__(None, None, None)
            return None
        return WholeGet(reads, views, begun.tenant, keys, self._served)

    def _names(
        self, begun: Begun, model: str, digests: Sequence[bytes]
    ) -> Sequence[StorageKey] | None:
        """The request's storage keys (admission's naming stage: raises as the server's
        would); None when one may be a block the server's index has evicted, its delete
        from LMDB still to commit (cacheserver.tiers.retiring): the server's index
        answers those. Asked before the snapshot is taken, so a delete committed after
        this is in it."""
        keys = self._checks.name(begun, model, digests).keys
        return None if self._reader.any_retiring(keys) else keys


class WholeGet:
    """A GET's blocks in one read transaction: `views` until the `with` block ends; a
    block that ends without an error counts them served (as the store's Reading does)."""

    def __init__(
        self,
        reads: BlockReads,
        views: list[memoryview],
        tenant: TenantId,
        keys: Sequence[StorageKey],
        served: ServedEvents,
    ) -> None:
        self._reads = reads
        self.views = views
        self.nbytes = sum(len(view) for view in views)
        self._tenant = tenant
        self._keys = keys
        self._served = served

    def __enter__(self) -> WholeGet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        blocks, self.views = len(self.views), []
        self._reads.__exit__(None, None, None)  # the transaction ends: its slot is free
        if exc_type is None:
            self._served.served(self._tenant, "lmdb", blocks, self.nbytes)
            self._served.got(self._tenant, len(self._keys), blocks)
            self._served.used(self._tenant, self._keys)
