"""The put journal's on-file format: superblock, record headers, their MAC, and the walk
along a ring's chain that recovery replays. No state, no locks: the ring
(`cacheserver.store.journal.ring`) writes with these functions, recovery reads with them.

Invariant: a header counts only if it carries this journal's MAC. `records_after`
follows the chain from a drain position and stops at the first header whose MAC fails
or whose sequence number does not follow, so bytes a tenant put in a payload can never
be taken for a record, even where the chain runs into stale space after a crash. A
header fits in one `ALIGN` slot, which never crosses a page: one `pwrite` of it leaves
the old header or the new one, never a mix.

Layout. A superblock in the first `DATA_START` bytes (magic, version, capacity, a
random journal id and a random MAC key, then the owning data dir's path), then records
at `ALIGN`-aligned offsets: a header in the first `ALIGN` bytes, then the payload. The
header carries the sequence number, the state (RESERVED, then COMMITTED once the
payload is complete), the block's storage key, tenant, epoch, model tag and size, the
xxh3-128 of the payload, and a keyed BLAKE2b MAC over all of that. A record that does
not fit before the end of the file is preceded by a wrap marker (a header with
`FLAG_WRAP`) and goes to `DATA_START`; when not even a header fits, the wrap is implicit.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import xxhash

from cacheserver.tiers import Position
from policy.types import ModelTag, StorageKey, TenantId

SUPER_MAGIC = b"KVSJRNL1"
RECORD_MAGIC = b"KVSJREC1"
VERSION = 1
DATA_START = 4096
ALIGN = 256
FLAG_WRAP = 1
FLAG_COMMITTED = 2
MAX_KEY_BYTES = 64
MAX_TENANT_BYTES = 64
ID_BYTES = 16
MAC_KEY_BYTES = 32
MAC_BYTES = 16
MAX_OWNER_BYTES = 2048  # the data dir's path, after the superblock's fixed fields
NO_CHECKSUM = bytes(16)  # a RESERVED record's: its payload is not complete yet

# magic | version | capacity | journal id | MAC key
_SUPER = struct.Struct(f">8sIQ{ID_BYTES}s{MAC_KEY_BYTES}s")
_OWNER_LENGTH = struct.Struct(">H")
# magic | flags | key length | tenant length | epoch | seq | size | key | model tag |
# tenant | payload checksum; then the MAC over these bytes
_HEAD = struct.Struct(f">8sBBBxIQQ{MAX_KEY_BYTES}s16s{MAX_TENANT_BYTES}s16s")
HEADER_BYTES = _HEAD.size + MAC_BYTES  # 216: inside one ALIGN slot, never across a page
SUPERBLOCK_READ_BYTES = _SUPER.size + _OWNER_LENGTH.size + MAX_OWNER_BYTES
assert HEADER_BYTES <= ALIGN and 4096 % ALIGN == 0


def record_bytes(payload_size: int) -> int:
    """Space one record of `payload_size` takes in the ring."""
    return ALIGN + (payload_size + ALIGN - 1) // ALIGN * ALIGN


def next_start(offset: int, capacity: int) -> int:
    """Where a record may begin at or after `offset` (an implicit wrap if no header fits)."""
    return DATA_START if capacity - offset < ALIGN else offset


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    key: StorageKey
    tenant: TenantId
    epoch: int
    model_tag: ModelTag
    payload: bytes
    end: int  # offset just past this record: where the chain continues


def _mac(key: bytes, journal_id: bytes, fields: bytes) -> bytes:
    return hashlib.blake2b(journal_id + fields, key=key, digest_size=MAC_BYTES).digest()


def pack_superblock(capacity: int, journal_id: bytes, mac_key: bytes, owner: str) -> bytes:
    """The superblock of a fresh journal; `owner` is its data dir (for orphan removal)."""
    owner_raw = owner.encode("utf-8")[:MAX_OWNER_BYTES]
    return (
        _SUPER.pack(SUPER_MAGIC, VERSION, capacity, journal_id, mac_key)
        + _OWNER_LENGTH.pack(len(owner_raw))
        + owner_raw
    )


def owner_of(raw: bytes) -> str | None:
    """The data dir recorded in a superblock's first bytes (`SUPERBLOCK_READ_BYTES` of
    the file); None when they are not a journal's."""
    if len(raw) < _SUPER.size + _OWNER_LENGTH.size or raw[: len(SUPER_MAGIC)] != SUPER_MAGIC:
        return None
    (length,) = _OWNER_LENGTH.unpack_from(raw, _SUPER.size)
    start = _SUPER.size + _OWNER_LENGTH.size
    return raw[start : start + length].decode("utf-8", "replace")


def pack_header(
    mac_key: bytes,
    journal_id: bytes,
    flags: int,
    seq: int,
    key: bytes,
    tenant: str,
    epoch: int,
    model_tag: bytes,
    size: int,
    checksum: bytes,
) -> bytes:
    """A record's header with its MAC: `HEADER_BYTES`, written with one `pwrite`."""
    tenant_raw = tenant.encode("utf-8")
    if len(key) > MAX_KEY_BYTES or len(tenant_raw) > MAX_TENANT_BYTES:
        raise ValueError("storage key or tenant too long for a journal record")
    fields = _HEAD.pack(
        RECORD_MAGIC,
        flags,
        len(key),
        len(tenant_raw),
        epoch,
        seq,
        size,
        bytes(key),
        model_tag,
        tenant_raw,
        checksum,
    )
    return fields + _mac(mac_key, journal_id, fields)


def records_after(
    fd: int, after: Position, on_corrupt: Callable[[TenantId], None] | None = None
) -> Iterator[Record]:
    """The committed records after `after` in the open journal file `fd`, in order.

    Yields nothing when the file belongs to another journal; skips records still
    RESERVED (never acknowledged); stops at the first header that fails its MAC or
    breaks the sequence, and at the end of the file. A committed record whose payload
    fails its checksum is skipped too, and reported to `on_corrupt` with its tenant
    (its header passed the MAC, so the tenant is the one that put it): an acknowledged
    block lost to corruption is counted, never served."""
    raw = os.pread(fd, _SUPER.size, 0)
    if len(raw) < _SUPER.size:
        return
    magic, version, capacity, journal_id, mac_key = _SUPER.unpack(raw)
    if magic != SUPER_MAGIC or version != VERSION or journal_id != after.journal_id:
        return
    capacity = min(capacity, os.fstat(fd).st_size)
    offset, seq = next_start(after.offset, capacity), after.seq
    while True:
        head = os.pread(fd, HEADER_BYTES, offset)
        if len(head) < HEADER_BYTES:
            return
        fields, mac = head[: _HEAD.size], head[_HEAD.size :]
        if not secrets.compare_digest(mac, _mac(mac_key, journal_id, fields)):
            return
        (_, flags, key_len, tenant_len, epoch, rec_seq, size, key, tag, tenant, checksum) = (
            _HEAD.unpack(fields)
        )
        if rec_seq != seq + 1:
            return
        if flags & FLAG_WRAP:
            offset = DATA_START
            continue
        end = offset + record_bytes(size)
        if end > capacity:
            return
        seq = rec_seq
        if flags & FLAG_COMMITTED:
            owner = TenantId(tenant[:tenant_len].decode("utf-8"))
            payload = os.pread(fd, size, offset + ALIGN)
            if len(payload) == size and xxhash.xxh3_128_digest(payload) == checksum:
                yield Record(
                    rec_seq, StorageKey(key[:key_len]), owner, epoch, ModelTag(tag), payload, end
                )
            elif on_corrupt is not None:
                on_corrupt(owner)
        offset = next_start(end, capacity)
