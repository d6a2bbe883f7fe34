"""What kvshare keeps in a Redis Cluster (cacheserver.tiers.cluster.layout, .deletes): block
headers that catch torn, corrupt and misplaced values; keys where only a tenant's own
keys share a hash slot; the delete log that undoes copies made during a delete."""

from __future__ import annotations

import hmac
import os

import xxhash
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.poly1305 import Poly1305
from redis.crc import key_slot

from cacheserver.tiers.cluster.deletes import (
    DeleteEntry,
    DeleteLog,
    from_fields,
    split_keys,
    to_fields,
)
from cacheserver.tiers.cluster.layout import (
    HEADER_BYTES,
    Keys,
    is_old_format,
    open_value,
    pack_header,
    unpack_header,
)
from kvcommon.encoding import enc
from policy.shared_values import ValueMac
from policy.types import ModelTag, StorageKey

TAG, OTHER_TAG, MODEL_TAG = os.urandom(16), os.urandom(16), ModelTag(os.urandom(16))
MAC = ValueMac(os.urandom(32))
NAME, OTHER_NAME = b"kvshare:b:" + b"1" * 64, b"kvshare:b:" + b"2" * 64


def _value(payload: bytes, tag: bytes = TAG, name: bytes = NAME, mac: ValueMac = MAC) -> bytes:
    return pack_header(mac, name, tag, 3, MODEL_TAG, payload) + payload


def test_a_whole_block_opens_and_anything_else_is_refused() -> None:
    payload = os.urandom(5000)
    value = _value(payload)
    opened = open_value(MAC, NAME, value, TAG)
    assert opened is not None and bytes(opened[0]) == payload and opened[1] == MODEL_TAG
    header = unpack_header(value)
    assert header is not None and (header.epoch, header.size) == (3, 5000)
    flipped = bytearray(value)
    flipped[HEADER_BYTES + 100] ^= 1
    assert open_value(MAC, NAME, bytes(flipped), TAG) is None  # corrupt
    assert open_value(MAC, NAME, value[:-1], TAG) is None  # torn
    assert open_value(MAC, NAME, value[: HEADER_BYTES - 1], TAG) is None  # not even a header
    assert open_value(MAC, NAME, value, OTHER_TAG) is None  # another tenant's block
    assert open_value(MAC, NAME, b"XXXX" + value[4:], TAG) is None  # not ours


def test_only_a_server_holding_the_secret_makes_a_value_that_opens() -> None:
    """The MAC binds the key name, the header and the payload: a value moved to another
    key, re-headed to another tenant, or made without the secret is refused."""
    payload = os.urandom(3000)
    value = _value(payload)
    assert open_value(MAC, OTHER_NAME, value, TAG) is None  # moved within the tenant
    reheaded = value[:4] + OTHER_TAG + value[20:]
    assert unpack_header(reheaded) is not None
    assert open_value(MAC, NAME, reheaded, OTHER_TAG) is None  # moved to another tenant
    stranger = _value(payload, mac=ValueMac(os.urandom(32)))  # another secret
    assert open_value(MAC, NAME, stranger, TAG) is None
    forged = bytearray(value)
    forged[-1] ^= 1
    forged[HEADER_BYTES - 16 : HEADER_BYTES] = xxhash.xxh3_128_digest(bytes(forged[HEADER_BYTES:]))
    assert open_value(MAC, NAME, bytes(forged), TAG) is None  # an unkeyed checksum redone
    again = _value(payload)  # a fresh salt each time: no two values share a one-time key
    assert again[:HEADER_BYTES] != value[:HEADER_BYTES]
    assert open_value(MAC, NAME, again, TAG) is not None  # positive control


def test_a_value_of_the_older_format_is_recognised_as_such() -> None:
    old = b"KVC1" + os.urandom(HEADER_BYTES + 10)
    assert unpack_header(old) is None and is_old_format(old)
    assert not is_old_format(_value(b"x"))


def test_only_a_tenants_own_keys_share_a_slot() -> None:
    keys = Keys("kvshare:")
    blocks = [keys.block(StorageKey(os.urandom(32))) for _ in range(64)]
    assert all(b"{" not in b and keys.is_block(b) for b in blocks)
    assert len({key_slot(b) for b in blocks}) > 32  # spread over the slots
    tenant = keys.tenant(TAG)
    names = [tenant.clock, tenant.epochs, tenant.doomed, *tenant.of_epoch(0), *tenant.of_epoch(7)]
    assert len({key_slot(n) for n in names}) == 1  # one slot: scripts are atomic there
    assert TAG.hex().encode() in tenant.clock and not keys.is_block(tenant.clock)


def test_the_delete_log_says_which_copies_a_delete_overtook() -> None:
    log = DeleteLog(keep=4)
    key, other = StorageKey(os.urandom(32)), StorageKey(os.urandom(32))
    before = log.generation
    assert not log.deleted_since(before, TAG, key, MODEL_TAG)
    log.record(DeleteEntry(keys=frozenset([key])))
    assert log.deleted_since(before, TAG, key, MODEL_TAG)
    assert not log.deleted_since(before, TAG, other, MODEL_TAG)  # positive control
    assert not log.deleted_since(log.generation, TAG, key, MODEL_TAG)  # started after it
    log.record(DeleteEntry(tenant_tag=TAG, model_tag=MODEL_TAG))
    assert log.deleted_since(before, TAG, other, MODEL_TAG)
    assert not log.deleted_since(before, TAG, other, ModelTag(os.urandom(16)))
    assert not log.deleted_since(before, OTHER_TAG, other, MODEL_TAG)
    for _ in range(4):  # the log forgets: an older copy is assumed overtaken
        log.record(DeleteEntry(keys=frozenset([key])))
    assert log.deleted_since(before, OTHER_TAG, other, MODEL_TAG)


def test_stream_entries_round_trip() -> None:
    keys = [StorageKey(os.urandom(32)) for _ in range(600)]
    entries = split_keys(keys)
    assert [len(e.keys) for e in entries] == [256, 256, 88]
    for entry in [
        *entries,
        DeleteEntry(tenant_tag=TAG),
        DeleteEntry(tenant_tag=TAG, model_tag=MODEL_TAG),
    ]:
        parsed = from_fields(to_fields(b"origin", entry))
        assert parsed == (b"origin", entry)
    assert from_fields({b"o": b"x", b"k": b"short"}) is None


def test_the_value_mac_is_the_documented_construction() -> None:
    """A known answer (a format change is never silent) and the construction in
    policy/shared_values.py's docstring, computed here from the primitives."""
    secret, name, header, payload = bytes(range(32)), b"kvshare:b:00", bytes(64), b"payload"
    tag = ValueMac(secret).tag(name, header, payload)
    assert tag.hex() == "1af2b5a5b6ebc49ac848b92875e7b31b"
    hkdf = HKDF(hashes.SHA256(), 32, None, enc("kvshare/shared-value/v1"))
    once = hmac.digest(hkdf.derive(secret), enc(name, header), "sha256")
    assert Poly1305.generate_tag(once, payload) == tag
