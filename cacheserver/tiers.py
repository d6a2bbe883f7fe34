"""The values that cross between the store's tiers.

This module imports nothing of the store or of any tier, so every tier (and the
journal, whose drain position LMDB records) can use these types without importing
another tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from policy.types import ModelTag, StorageKey, TenantId

# A block's bytes as the store holds them: bytes from gRPC, the receive buffer itself
# (bytearray, never written again), or a view of its record in the put journal, where
# the bulk channel received it; no path copies.
Payload: TypeAlias = bytes | bytearray | memoryview

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
