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

`Erasure` deletes blocks from the cluster itself, by key, by tenant or model, or a
retired epoch, releasing their accounting.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cacheserver.tiers.cluster.accounting import Accounting, Tenant
from cacheserver.tiers.cluster.layout import HEADER_BYTES, Keys, unpack_header
from cacheserver.tiers.cluster.nodes import ClusterNodes, Failed
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


class Erasure:
    """Deleting blocks from the cluster, with their accounting (no local copies, no
    stream: `ClusterTier` does those). Each header says which tenant's list to change."""

    def __init__(self, nodes: ClusterNodes, keys: Keys, accounting: Accounting) -> None:
        self._nodes = nodes
        self._keys = keys
        self._accounting = accounting

    def delete_blocks(self, keys: Sequence[StorageKey]) -> tuple[set[StorageKey], bool]:
        """Delete blocks from the cluster and their accounting: (those held, whether
        every node answered). Each header says which tenant's list to change."""
        names = [self._keys.block(key) for key in keys]
        ranges = self._nodes.run([(n, ("GETRANGE", n, 0, HEADER_BYTES - 1)) for n in names])
        complete = not any(isinstance(r, Failed) for r in ranges)
        groups: dict[tuple[bytes, int], list[StorageKey]] = {}
        for key, raw in zip(keys, ranges, strict=True):
            header = None if isinstance(raw, Failed) else unpack_header(raw)
            if header is not None:
                groups.setdefault((header.tenant_tag, header.epoch), []).append(key)
        for (tag, epoch), members in groups.items():
            complete = (
                not isinstance(self._accounting.release(tag, epoch, members), Failed) and complete
            )
        held = set()
        deleted = self._nodes.run([(n, ("DEL", n)) for n in names])
        for key, answer in zip(keys, deleted, strict=True):
            complete = complete and not isinstance(answer, Failed)
            if answer == 1:
                held.add(key)
        return held, complete

    def delete_tenant_blocks(
        self, tenant: Tenant, model_tag: ModelTag | None, epochs: Iterable[int] | None = None
    ) -> tuple[set[StorageKey], bool]:
        """Every block of the tenant (or of one model of it) in the given epochs (all it
        has, by default): (those deleted, whether every node answered)."""
        if epochs is None:
            found = self._accounting.epochs(tenant)
            if isinstance(found, Failed):
                return set(), False
            epochs = found
        held: set[StorageKey] = set()
        complete = True
        for epoch in sorted(epochs):
            if model_tag is None:
                gone, ok = self._take_all(tenant, epoch)
            else:
                gone, ok = self._delete_model(tenant, epoch, model_tag)
            held |= gone
            complete = complete and ok
        return held, complete

    def _take_all(self, tenant: Tenant, epoch: int) -> tuple[set[StorageKey], bool]:
        held: set[StorageKey] = set()
        while True:
            taken = self._accounting.take(tenant, epoch)
            if isinstance(taken, Failed):
                return held, False
            if not taken:
                return held, True
            names = [self._keys.block(key) for key in taken]
            for key, answer in zip(
                taken, self._nodes.run([(n, ("DEL", n)) for n in names]), strict=True
            ):
                if answer == 1:
                    held.add(key)

    def _delete_model(
        self, tenant: Tenant, epoch: int, model_tag: ModelTag
    ) -> tuple[set[StorageKey], bool]:
        listed = self._accounting.listed(tenant, epoch)
        if isinstance(listed, Failed):
            return set(), False
        names = [self._keys.block(key) for key in listed]
        ranges = self._nodes.run([(n, ("GETRANGE", n, 0, HEADER_BYTES - 1)) for n in names])
        ours = []
        for key, raw in zip(listed, ranges, strict=True):
            header = None if isinstance(raw, Failed) else unpack_header(raw)
            if header is not None and header.model_tag == model_tag:
                ours.append(key)
        held, complete = self.delete_blocks(ours) if ours else (set(), True)
        return held, complete and not any(isinstance(r, Failed) for r in ranges)
