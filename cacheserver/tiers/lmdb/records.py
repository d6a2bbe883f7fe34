"""What LMDB holds beside each block: its meta record (checksum, size, epoch, clock,
model tag, tenant), written in the same transaction as the payload, and the checksum
every read verifies before a byte leaves the read transaction.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from cacheserver.tiers import NO_MODEL_TAG, Payload, PendingWrite
from policy.types import ModelTag, StorageKey, TenantId

# checksum (16) | size (8) | epoch (4) | clock (8) | then the tenant id in UTF-8
_META = struct.Struct(">16sQIQ16s")  # checksum, size, epoch, clock, model tag


@dataclass(frozen=True, slots=True)
class StoredMeta:
    key: StorageKey
    tenant: TenantId
    size: int
    epoch: int
    clock: int
    model_tag: ModelTag = NO_MODEL_TAG


def checksum(payload: Payload) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def intact(raw: Payload, digest: bytes, meta: StoredMeta) -> bool:
    """Whether a block's bytes are what its meta record says was committed: its size,
    then its checksum. Every read from LMDB (the server's tier, a bulk worker's reader)
    asks this before a byte leaves the read transaction."""
    return len(raw) == meta.size and checksum(raw) == digest


def pack_meta(w: PendingWrite, digest: bytes) -> bytes:
    return _META.pack(digest, len(w.payload), w.epoch, w.clock, w.model_tag) + w.tenant.encode(
        "utf-8"
    )


def unpack_meta(key: bytes | memoryview, raw: bytes | memoryview) -> tuple[bytes, StoredMeta]:
    digest, size, epoch, clock, tag = _META.unpack_from(raw)
    tenant = TenantId(bytes(raw[_META.size :]).decode("utf-8"))
    return digest, StoredMeta(StorageKey(bytes(key)), tenant, size, epoch, clock, ModelTag(tag))
