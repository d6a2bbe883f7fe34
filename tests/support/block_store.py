"""A block store's parts without a server: storage settings over a temporary directory,
tenants, a model tag, keys, and a source that fills the store's target as the bulk
channel does."""

from __future__ import annotations

import os
from pathlib import Path

from cacheserver.config import StorageConfig
from policy.types import ModelTag, StorageKey, TenantId

KiB, MiB = 1 << 10, 1 << 20


A, B = TenantId("alpha"), TenantId("beta")


TAG, OTHER_TAG = ModelTag(bytes(16)), ModelTag(bytes(range(16)))


class FillSource:
    """A source that writes its bytes into the store's target, as the bulk channel does."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.skipped = False

    @property
    def size(self) -> int:
        return len(self.data)

    def payload(self) -> None:
        return None

    def fill(self, target: memoryview) -> None:
        target[:] = self.data

    def skip(self) -> None:
        self.skipped = True


def keys(n: int) -> list[StorageKey]:
    return [StorageKey(os.urandom(32)) for _ in range(n)]


def storage(tmp_path: Path, journaled: bool, **overrides: int) -> StorageConfig:
    settings: dict[str, int | str] = {
        "memory_budget_bytes": 4 * MiB,
        "disk_budget_bytes": 64 * MiB,
        "journal_bytes": 16 * MiB if journaled else 0,
        "journal_dir": str(tmp_path / "journal"),
        "sync_interval_ms": 0,
    }
    settings.update(overrides)
    return StorageConfig(**settings)  # type: ignore[arg-type]
