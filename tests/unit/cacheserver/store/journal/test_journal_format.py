"""The put journal's file format: headers, their MAC, and the chain recovery follows.

Files are built here with the format's own functions (no ring), or written by a ring
and then tampered with on disk, as a crash or a local attacker would leave them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from cacheserver.store.journal import ALIGN, DATA_START, MIN_CAPACITY, Journal, record_bytes, replay
from cacheserver.store.journal.format import (
    FLAG_COMMITTED,
    FLAG_WRAP,
    HEADER_BYTES,
    MAX_KEY_BYTES,
    NO_CHECKSUM,
    SUPERBLOCK_READ_BYTES,
    next_start,
    owner_of,
    pack_header,
    pack_superblock,
    records_after,
)
from cacheserver.tiers import Position
from policy.types import ModelTag, StorageKey, TenantId

TAG = ModelTag(bytes(range(16)))
JOURNAL_ID, MAC_KEY = bytes(range(16)), bytes(range(32, 64))
CAPACITY = 64 << 10


def key(n: int) -> StorageKey:
    return StorageKey(n.to_bytes(32, "big"))


def header(
    seq: int, payload: bytes, flags: int = FLAG_COMMITTED, mac_key: bytes = MAC_KEY
) -> bytes:
    checksum = xxhash.xxh3_128_digest(payload) if flags & FLAG_COMMITTED else NO_CHECKSUM
    return pack_header(
        mac_key, JOURNAL_ID, flags, seq, key(seq), "alpha", 7, TAG, len(payload), checksum
    )


def hand_built(path: Path, records: list[tuple[int, bytes, bytes]]) -> list[int]:
    """A journal file of `records` (offset, header, payload) after a superblock;
    returns each record's end."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, CAPACITY)
        os.pwrite(fd, pack_superblock(CAPACITY, JOURNAL_ID, MAC_KEY, "/data"), 0)
        for offset, head, payload in records:
            os.pwrite(fd, head, offset)
            os.pwrite(fd, payload, offset + ALIGN)
    finally:
        os.close(fd)
    return [offset + record_bytes(len(payload)) for offset, _, payload in records]


def walk(path: Path, after: Position) -> list[tuple[int, bytes]]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return [(r.seq, r.payload) for r in records_after(fd, after)]
    finally:
        os.close(fd)


START = Position(JOURNAL_ID, 0, DATA_START)


def test_a_hand_built_chain_is_walked_in_order_with_every_field(tmp_path: Path) -> None:
    second = DATA_START + record_bytes(5)
    ends = hand_built(
        tmp_path / "j",
        [(DATA_START, header(1, b"first"), b"first"), (second, header(2, b"two"), b"two")],
    )
    fd = os.open(tmp_path / "j", os.O_RDONLY)
    try:
        records = list(records_after(fd, START))
    finally:
        os.close(fd)
    assert [(r.seq, r.key, r.tenant, r.epoch, r.model_tag, r.payload) for r in records] == [
        (1, key(1), "alpha", 7, TAG, b"first"),
        (2, key(2), "alpha", 7, TAG, b"two"),
    ]
    assert [r.end for r in records] == ends
    assert walk(tmp_path / "j", Position(JOURNAL_ID, 1, ends[0])) == [(2, b"two")]
    assert walk(tmp_path / "j", Position(bytes(16), 0, DATA_START)) == []  # another journal


def test_a_header_under_another_key_or_out_of_sequence_ends_the_chain(tmp_path: Path) -> None:
    second, third = DATA_START + ALIGN * 2, DATA_START + ALIGN * 4
    records = [
        (DATA_START, header(1, b"a"), b"a"),
        (second, header(2, b"b", mac_key=bytes(32)), b"b"),  # forged: another key
        (third, header(3, b"c"), b"c"),
    ]
    hand_built(tmp_path / "forged", records)
    assert walk(tmp_path / "forged", START) == [(1, b"a")]
    records[1] = (second, header(3, b"b"), b"b")  # a valid MAC, but seq 3 after 1
    hand_built(tmp_path / "skipped", records)
    assert walk(tmp_path / "skipped", START) == [(1, b"a")]
    records[1] = (second, header(2, b"b"), b"b")  # positive control: the whole chain
    hand_built(tmp_path / "whole", records)
    assert walk(tmp_path / "whole", START) == [(1, b"a"), (2, b"b"), (3, b"c")]


def test_reserved_records_and_torn_payloads_are_skipped_and_the_chain_goes_on(
    tmp_path: Path,
) -> None:
    offsets = [DATA_START + ALIGN * 2 * i for i in range(3)]
    hand_built(
        tmp_path / "j",
        [
            (offsets[0], header(1, b"receiving", flags=0), b"receivin"),  # never committed
            (offsets[1], header(2, b"whole"), b"torn!"),  # committed, payload not as summed
            (offsets[2], header(3, b"kept"), b"kept"),
        ],
    )
    assert walk(tmp_path / "j", START) == [(3, b"kept")]
    # The committed record whose payload fails its checksum is reported, with its
    # tenant (replay counts it as an integrity failure); the RESERVED one is not.
    corrupt: list[TenantId] = []
    fd = os.open(tmp_path / "j", os.O_RDONLY)
    try:
        kept = [r.seq for r in records_after(fd, START, on_corrupt=corrupt.append)]
    finally:
        os.close(fd)
    assert kept == [3]
    assert corrupt == [TenantId("alpha")]


def test_a_wrap_marker_sends_the_chain_back_to_the_start(tmp_path: Path) -> None:
    wrap_at = CAPACITY - ALIGN * 2  # room for a header, not for the record
    hand_built(
        tmp_path / "j",
        [
            (
                wrap_at,
                pack_header(MAC_KEY, JOURNAL_ID, FLAG_WRAP, 6, b"", "", 0, TAG, 0, NO_CHECKSUM),
                b"",
            ),
            (DATA_START, header(6, b"x" * 1000), b"x" * 1000),
        ],
    )
    assert walk(tmp_path / "j", Position(JOURNAL_ID, 5, wrap_at)) == [(6, b"x" * 1000)]
    # where not even a header fits, the wrap is implicit
    assert next_start(CAPACITY - ALIGN + 1, CAPACITY) == DATA_START
    assert next_start(CAPACITY - ALIGN, CAPACITY) == CAPACITY - ALIGN


def test_a_header_tampered_on_disk_stops_replay_there(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    written = []
    for n in range(3):
        reservation = journal.reserve(key(n), TenantId("alpha"), 1, TAG, 100)
        reservation.view[:] = bytes([n]) * 100
        journal.commit(reservation)
        written.append(reservation)
    assert [r.seq for r in replay(journal.path, journal.start)] == [1, 2, 3]  # control
    epoch_field = written[1].offset + 12  # magic 8, flags, lengths, pad: then the epoch
    fd = os.open(journal.path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\x02", epoch_field)
    finally:
        os.close(fd)
    assert [r.seq for r in replay(journal.path, journal.start)] == [1]
    journal.close(remove=True)


def test_headers_fit_one_slot_and_refuse_fields_too_long() -> None:
    assert HEADER_BYTES <= ALIGN
    assert record_bytes(0) == ALIGN and record_bytes(1) == 2 * ALIGN
    assert record_bytes(ALIGN) == 2 * ALIGN and record_bytes(ALIGN + 1) == 3 * ALIGN
    with pytest.raises(ValueError, match="too long"):
        pack_header(
            MAC_KEY, JOURNAL_ID, 0, 1, b"k" * (MAX_KEY_BYTES + 1), "a", 0, TAG, 0, NO_CHECKSUM
        )
    with pytest.raises(ValueError, match="too long"):
        pack_header(MAC_KEY, JOURNAL_ID, 0, 1, b"k", "t" * 65, 0, TAG, 0, NO_CHECKSUM)


def test_the_superblock_records_its_data_dir() -> None:
    raw = pack_superblock(CAPACITY, JOURNAL_ID, MAC_KEY, "/srv/kvshare/data")
    assert owner_of(raw) == "/srv/kvshare/data"
    assert owner_of(pack_superblock(CAPACITY, JOURNAL_ID, MAC_KEY, "")) == ""
    assert owner_of(b"not a journal" * 10) is None
    assert owner_of(raw[:10]) is None
    assert len(pack_superblock(CAPACITY, JOURNAL_ID, MAC_KEY, "x" * 5000)) <= SUPERBLOCK_READ_BYTES


def test_records_forged_inside_a_payload_are_never_replayed(tmp_path: Path) -> None:
    """A tenant controls payload bytes; stale space after a crash can hold them where
    the chain goes on. Headers forged there lack the journal's MAC key."""
    victim = Journal(tmp_path / "victim", MIN_CAPACITY)
    donor = Journal(tmp_path / "donor", MIN_CAPACITY)  # same format, another key
    forged = donor.reserve(key(9), TenantId("beta"), 1, TAG, ALIGN)
    forged.view[:] = b"poison" * (ALIGN // 6) + b"p" * (ALIGN % 6)
    donor.commit(forged)
    with open(donor.path, "rb") as f:  # a complete, well-formed record of the donor
        f.seek(forged.offset)
        record = f.read(record_bytes(ALIGN))
    reservation = victim.reserve(key(0), TenantId("alpha"), 1, TAG, len(record) * 8)
    reservation.view[:] = record * 8
    victim.commit(reservation)  # the attacker's payload: copies of it
    payload_start = DATA_START + ALIGN
    for skip in range(8):  # a chain resuming anywhere inside that payload
        at = Position(victim.journal_id, 1, payload_start + skip * len(record))
        assert list(replay(victim.path, at)) == []
    assert [r.payload for r in replay(victim.path, victim.start)] == [record * 8]  # control
