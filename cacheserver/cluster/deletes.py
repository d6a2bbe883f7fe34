"""How a delete reaches every server's local copies.

A delete through one server removes the blocks from its own tiers and from the cluster,
then appends an entry to the cluster's delete stream (`P deletes`, trimmed to about
`delete_stream_entries` entries); every server follows the stream and drops its own
copies (`follower`). Entries carry storage keys (as the block keys do) or a namespace
(tenant tag, model tag): no tenant id, no digest.

Copies made while a delete runs are the race to close: a server may have read a block
from the cluster just before it was deleted and be about to keep it (a promotion), or be
about to write its own copy to the cluster. Both note the `DeleteLog` generation before
they copy and ask it afterwards whether a delete of that block came in between; if so
they undo the copy. The log numbers each delete before it takes effect anywhere.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from policy.types import ModelTag, StorageKey

KEYS_PER_ENTRY = 256  # 8 KiB of keys: a large delete becomes several stream entries


@dataclass(frozen=True, slots=True)
class DeleteEntry:
    keys: frozenset[StorageKey] = frozenset()
    tenant_tag: bytes = b""  # set: a namespace delete of this tenant...
    model_tag: bytes = b""  # ...of this model only (b"": all of it)

    def covers(self, tenant_tag: bytes, key: StorageKey, model_tag: ModelTag) -> bool:
        if self.tenant_tag:
            return self.tenant_tag == tenant_tag and self.model_tag in (b"", model_tag)
        return key in self.keys


class DeleteLog:
    def __init__(self, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._entries: deque[tuple[int, DeleteEntry]] = deque(maxlen=keep)
        self.generation = 0

    def record(self, entry: DeleteEntry) -> None:
        """A delete is about to take effect: copies started before it must check."""
        with self._lock:
            self.generation += 1
            self._entries.append((self.generation, entry))

    def deleted_since(
        self, generation: int, tenant_tag: bytes, key: StorageKey, model_tag: ModelTag
    ) -> bool:
        with self._lock:
            if self.generation == generation:
                return False
            if not self._entries or self._entries[0][0] > generation + 1:
                return True  # forgotten: assume the worst
            return any(
                g > generation and entry.covers(tenant_tag, key, model_tag)
                for g, entry in self._entries
            )


def to_fields(origin: bytes, entry: DeleteEntry) -> dict[bytes, bytes]:
    if entry.tenant_tag:
        return {b"o": origin, b"t": entry.tenant_tag, b"m": entry.model_tag}
    return {b"o": origin, b"k": b"".join(sorted(entry.keys))}


def from_fields(fields: dict[bytes, bytes]) -> tuple[bytes, DeleteEntry] | None:
    """(origin, entry) of a stream entry, or None when it is not one of ours."""
    origin = fields.get(b"o", b"")
    if b"t" in fields:
        return origin, DeleteEntry(tenant_tag=fields[b"t"], model_tag=fields.get(b"m", b""))
    raw = fields.get(b"k")
    if raw is None or len(raw) % 32:
        return None
    keys = frozenset(StorageKey(raw[i : i + 32]) for i in range(0, len(raw), 32))
    return origin, DeleteEntry(keys=keys)


def split_keys(keys: Sequence[StorageKey]) -> list[DeleteEntry]:
    return [
        DeleteEntry(keys=frozenset(keys[i : i + KEYS_PER_ENTRY]))
        for i in range(0, len(keys), KEYS_PER_ENTRY)
    ]
