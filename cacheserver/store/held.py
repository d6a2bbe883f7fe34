"""`HeldPuts`: what the index-guarded tiers (`tiering.IndexedTiers`) ask of the puts
held in the put journal and not yet in LMDB (`journaled.JournaledPuts` implements it).

Declared apart from both so that the dependency runs one way: the journaled puts build
on the index-guarded tiers, which know the journal only through this interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cacheserver.tiers import Payload
from policy.types import StorageKey


class HeldPuts(Protocol):
    """What the index-guarded tiers ask of the puts held in the journal, not yet in LMDB.
    Called under their lock (`IndexedTiers.lock`)."""

    def held(self, keys: Sequence[StorageKey]) -> dict[StorageKey, Payload]:
        """The record views of those `keys` that are journaled and not yet in LMDB."""
        ...

    def holds(self, key: StorageKey) -> bool: ...

    def delete(self, keys: Sequence[StorageKey]) -> int: ...

    @property
    def undrained_blocks(self) -> int: ...

    def close(self) -> None: ...
