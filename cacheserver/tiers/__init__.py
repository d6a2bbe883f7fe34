"""What the store's tiers have in common, and the values that cross between them.

A tier holds blocks by storage key and answers for those blocks only: it never decides
what exists (the store's index does, see `cacheserver.store`) and never evicts on its
own behalf except where it says so (the memory tier's LRU). Each implementation states
its thread contract, because that is what the store's composition depends on:

- in-process tiers (`MemoryTier`, the journal's `JournaledPuts`) are called under the
  store's lock and never block;
- lower tiers (`LmdbTier`; the Redis Cluster tier next, issue 17) do blocking I/O and
  are called outside that lock, from executor threads or the store's writer thread.

This module imports nothing of the store or of any tier, so every tier (and the
journal, whose drain position LMDB records) can use these types without importing
another tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias, runtime_checkable

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


class Tier(Protocol):
    """A place that holds blocks by storage key (memory, put journal, LMDB, ...)."""

    def read_many(self, keys: Sequence[StorageKey]) -> Sequence[Payload | None]:
        """The payloads of `keys` held here, None for each key that is not (a tier
        that verifies its bytes answers None for a corrupt block, and drops it)."""
        ...

    def delete(self, keys: Sequence[StorageKey]) -> int:
        """Stop holding `keys`; returns how many of them were held. A durable tier
        returns only once the deletion is durable."""
        ...

    def close(self) -> None:
        """Let go of the tier's resources; called once, when the store stops."""
        ...


class LowerTier(Tier, Protocol):
    """A durable tier below memory: blocking, called outside the store's lock.

    The store writes blocks into its first lower tier (LMDB, which the index mirrors)
    with one group commit at a time, and then into every further lower tier (written
    behind: their failures never fail a put). Reads of indexed blocks fall through the
    lower tiers in order; deletes reach every one. See `cacheserver.store`."""

    def write(self, writes: Sequence[PendingWrite], deletes: Sequence[StorageKey]) -> list[bool]:
        """Delete `deletes`, then store `writes` first-writer-wins, in one durable step.
        Returns, per write, whether it was stored (False: the key was held already).
        Raises when nothing was written; a partial write is never reported as done."""
        ...

    def probe(self) -> str | None:
        """Why the tier cannot take writes now (a short reason for health), or None."""
        ...


@runtime_checkable
class SharedTier(LowerTier, Protocol):
    """A lower tier that several servers use at once (issue 17: the Redis Cluster,
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
