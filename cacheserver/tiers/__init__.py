"""The one interface every tier implements (`Tier`), what a tier may declare beyond it
(`Capability`, `SharedTier`), and the values that cross between tiers and the store.

A tier holds blocks by storage key and answers for those blocks only: it never decides
what exists (the store's index does, see `cacheserver.store`) and never evicts on its
own behalf except where it says so (the memory tier's LRU). The store holds its tiers
as an ordered list, fastest first (memory, LMDB, then any tier behind), and treats each
the same way except where a tier declares a capability. Its thread contract follows
from one of them:

- an `IN_PROCESS` tier (`MemoryTier`) is called under the store's lock and never blocks;
- every other tier (`LmdbTier`, `ClusterTier`) does blocking I/O and is called outside
  that lock, from executor threads or the store's writer thread.

No tier holds a reference to the store. A tier that needs this server's own copies
(the shared tier: to write a block it only queued, to keep a copy of a block it served,
to drop copies that a delete through another server took away) gets `LocalCopies`,
a narrow view the store implements, in `start`.

This module imports nothing of the store or of any tier, so every tier (and the
journal, whose drain position LMDB records) can use these types without importing
another tier.
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias, runtime_checkable

from cacheserver.blocks import BlockSource
from cacheserver.blocks import Payload as Payload
from policy.types import ModelTag, StorageKey, TenantId

NO_MODEL_TAG = ModelTag(bytes(16))  # blocks written without a model tag


@dataclass(frozen=True, slots=True)
class Position:
    """Where the put journal's chain continues after everything up to `seq` (inclusive)."""

    journal_id: bytes
    seq: int
    offset: int


# How far a journal (at this path) has been moved into a lower tier: recorded in the same
# commit as the blocks it covers, so a replay after a crash starts exactly there.
JournalCheckpoint: TypeAlias = tuple[Position, Path]


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """A block on its way into a lower tier, with what that tier must keep beside it."""

    key: StorageKey
    tenant: TenantId
    epoch: int
    clock: int  # the index's recency clock at admission, kept so a restart keeps the order
    payload: Payload
    model_tag: ModelTag = NO_MODEL_TAG
    # The payload's xxh3-128 when it was computed already (the journal's, at commit);
    # None: the tier computes it.
    checksum: bytes | None = None


class Capability(enum.Flag):
    """What a tier declares beyond the `Tier` interface. The store reads it once, when
    it is assembled (`cacheserver.store.tiering.IndexedTiers`), into separate lists of tiers;
    no call path branches on a tier's type."""

    NONE = 0
    # Called under the store's lock, never blocking (the memory tier). Holds a subset of
    # what the tiers below hold: dropping a block there loses nothing.
    IN_PROCESS = enum.auto()
    # `write` takes blocks on and stores them later, on the tier's own threads: it
    # answers what it took on, not what has landed (that is in `counts`).
    QUEUED_WRITES = enum.auto()
    # The server serves without it: its `probe` is a health of its own, watched by the
    # server's assembly, and never makes the store refuse writes.
    OWN_HEALTH = enum.auto()
    # Other servers use it too (a `SharedTier`): it holds blocks the index does not
    # list, so the store asks it on an index miss, tells it of every acknowledged put,
    # and sends deletes through it so that they reach the other servers.
    SHARED = enum.auto()


class LocalCopies(Protocol):
    """What a tier may ask of this server's own copies (memory, journal, LMDB): the
    store implements it and hands it to every tier in `Tier.start`. Blocking."""

    def keep_copy(
        self, tenant: TenantId, key: StorageKey, model_tag: ModelTag, source: BlockSource
    ) -> concurrent.futures.Future[bool]:
        """Put a block into the local tiers (as a put would: first writer wins)."""
        ...

    def local_copy(self, key: StorageKey) -> bytes | bytearray | None:
        """The local copy of a block, as bytes that stay valid; None if none is held."""
        ...

    def local_keys(self, tenant: TenantId) -> list[tuple[StorageKey, ModelTag]]:
        """The keys held locally of `tenant`, each with its model tag."""
        ...

    def forget_local(
        self,
        keys: Sequence[StorageKey] = (),
        namespace: tuple[TenantId, ModelTag | None] | None = None,
    ) -> int:
        """Drop the local copies of `keys`, or of a namespace (a tenant, and a model tag
        or None for all of it), durably; how many were held."""
        ...


class Tier(Protocol):
    """A place that holds blocks by storage key: memory, LMDB, the Redis Cluster, ...

    Every tier keeps the same contract; what only some tiers do is declared in
    `capabilities`. Blocking and called outside the store's lock unless it declares
    `Capability.IN_PROCESS`."""

    @property
    def name(self) -> str:
        """A short name for logs and metrics ("memory", "lmdb", "redis_cluster")."""
        ...

    @property
    def capabilities(self) -> Capability: ...

    def read_many(self, keys: Sequence[StorageKey]) -> Sequence[Payload | None]:
        """The payloads of `keys` held here, None for each key that is not (a tier
        that verifies its bytes answers None for a corrupt block, and drops it)."""
        ...

    def write(self, writes: Sequence[PendingWrite], deletes: Sequence[StorageKey]) -> list[bool]:
        """Delete `deletes`, then store `writes` first-writer-wins; a durable tier does
        it in one durable step. Returns, per write, whether this write stored it: False
        when the key was held already, or a cache tier (`IN_PROCESS`) or a full queue
        declined it. A `QUEUED_WRITES` tier answers True for a write it took on to store
        soon, and counts in `counts` what landed and what it had to drop.
        Raises when nothing was written; a partial write is never reported as done."""
        ...

    def delete(self, keys: Sequence[StorageKey]) -> int:
        """Stop holding `keys`; returns how many of them were held. A durable tier
        returns only once the deletion is durable."""
        ...

    def probe(self) -> str | None:
        """Why the tier cannot take writes now (a short reason for health), or None."""
        ...

    def start(self, local: LocalCopies) -> None:
        """Start what runs on the tier's own threads, once the store exists (the store
        calls it once; most tiers have nothing to start)."""
        ...

    def stop(self) -> None:
        """Stop the tier's threads, before the store closes (they may use `LocalCopies`).
        Idempotent."""
        ...

    def close(self) -> None:
        """Let go of the tier's resources; called once, last, when the store stops."""
        ...

    def counts(self) -> Mapping[str, int]:
        """What the tier holds or did since start, for metrics: counts and sizes only,
        never keys or tenants."""
        ...


@runtime_checkable
class SharedTier(Tier, Protocol):
    """A tier that several servers use at once (`Capability.SHARED`; the Redis Cluster,
    `cacheserver.tiers.cluster`). It holds blocks the index may not list (written through
    another server, or evicted here), so the store asks it on an index miss, and it
    carries deletes to the other servers. Blocking, thread-safe, never under the lock."""

    def count_leading(self, tenant: TenantId, keys: Sequence[StorageKey], local: int) -> int:
        """How many of `keys[local:]`, leading, it holds (`keys[:local]` are held
        locally: it notes their use, as the tenant's recency spans servers)."""
        ...

    def read_leading(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """The leading payloads of `keys` it holds (about `max_bytes`, at least one), and
        whether the key after them may be held."""
        ...

    def share(self, tenant: TenantId, key: StorageKey, model_tag: ModelTag) -> None:
        """A block was just acknowledged here: write it to the shared tier soon."""
        ...

    def delete_held(self, keys: Sequence[StorageKey]) -> set[StorageKey]:
        """Delete `keys` everywhere (here, and the other servers' copies); the ones it held."""
        ...

    def delete_namespace(self, tenant: TenantId, model_tag: ModelTag | None) -> set[StorageKey]:
        """Delete every block of the tenant (or of one model of it) everywhere; the
        ones it held."""
        ...
