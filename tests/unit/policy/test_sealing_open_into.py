"""BlockSealer.open_into: a sealed block opened into a buffer the caller owns, with
open's checks; a block that fails to open leaves no plaintext in that buffer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from policy import sealing
from policy.sealing import (
    HEADER_BYTES,
    TAG_BYTES,
    BlockSealer,
    Keyring,
    SealError,
    TenantKeys,
    opened_bytes,
)

VECTORS = Path(__file__).resolve().parents[2] / "vectors"
SEALED = json.loads((VECTORS / "sealed_blocks.json").read_text())["cases"]
KEY = os.urandom(32)
SEALER = BlockSealer(Keyring({"alpha": TenantKeys({1: KEY}), "beta": TenantKeys({1: KEY})}))
DIGEST = os.urandom(32)
PLAINTEXT = os.urandom(3 * 4096 + 5)


def sealed_block() -> bytes:
    return SEALER.seal("alpha", "m", DIGEST, PLAINTEXT)


@pytest.mark.parametrize("case", SEALED, ids=lambda c: c["name"])
def test_open_into_opens_the_known_answer_vectors(case: dict[str, Any]) -> None:
    keys = TenantKeys({case["key_version"]: bytes.fromhex(case["key_hex"])})
    sealer = BlockSealer(Keyring({case["tenant"]: keys}))
    sealed = bytes.fromhex(case["sealed_hex"])
    out = bytearray(opened_bytes(sealed) + 7)  # room to spare: only the plaintext is used
    digest = bytes.fromhex(case["digest_hex"])
    opened = sealer.open_into(case["tenant"], case["model"], digest, sealed, out)
    assert bytes(opened) == bytes.fromhex(case["plaintext_hex"])
    assert opened.obj is out  # a view of the caller's buffer, not a copy
    assert out[opened.nbytes :] == bytes(7)


def test_a_tampered_block_is_refused_and_leaves_no_plaintext_in_the_buffer() -> None:
    sealed = sealed_block()
    out = bytearray(opened_bytes(sealed))
    assert bytes(SEALER.open_into("alpha", "m", DIGEST, sealed, out)) == PLAINTEXT  # control
    for where in (HEADER_BYTES, len(sealed) // 2, len(sealed) - TAG_BYTES - 1, len(sealed) - 1):
        tampered = bytearray(sealed)
        tampered[where] ^= 0x01  # ciphertext (first, middle, last byte) and the tag
        out[:] = b"\xaa" * len(out)
        with pytest.raises(SealError, match=r"^block cannot be opened$"):
            SEALER.open_into("alpha", "m", DIGEST, bytes(tampered), memoryview(out))
        # AES-GCM decrypted into it before the tag failed: nothing of that is left
        assert out == bytes(len(out))


def test_a_block_under_another_binding_is_refused() -> None:
    sealed = sealed_block()
    out = bytearray(len(PLAINTEXT))
    assert bytes(SEALER.open_into("alpha", "m", DIGEST, sealed, out)) == PLAINTEXT  # control
    for tenant, model, digest in (
        ("beta", "m", DIGEST),  # same key bytes, another tenant
        ("alpha", "m2", DIGEST),
        ("alpha", "m", bytes(a ^ 1 for a in DIGEST)),
        ("gamma", "m", DIGEST),  # no key at all
    ):
        out[:] = b"\xaa" * len(out)
        with pytest.raises(SealError):
            SEALER.open_into(tenant, model, digest, sealed, out)
        assert out in (bytes(len(out)), b"\xaa" * len(out))  # zeroed, or never written


def test_truncated_blocks_and_buffers_too_small_are_refused() -> None:
    sealed = sealed_block()
    out = bytearray(len(PLAINTEXT))
    for short in (sealed[: HEADER_BYTES + TAG_BYTES - 1], sealed[:-1], b""):
        with pytest.raises(SealError):
            SEALER.open_into("alpha", "m", DIGEST, short, out)
    assert opened_bytes(b"") == 0 and opened_bytes(sealed) == len(PLAINTEXT)
    small = bytearray(len(PLAINTEXT) - 1)
    with pytest.raises(SealError):
        SEALER.open_into("alpha", "m", DIGEST, sealed, small)
    assert small == bytes(len(small))  # nothing written


def test_a_read_only_buffer_is_a_caller_error() -> None:
    sealed = sealed_block()
    with pytest.raises(ValueError, match="read-only; pass a writable buffer"):
        SEALER.open_into("alpha", "m", DIGEST, sealed, memoryview(bytes(len(PLAINTEXT))))


def test_without_decrypt_into_open_into_decrypts_then_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cryptography releases in the declared range before AESGCM.decrypt_into."""
    monkeypatch.setattr(sealing, "DECRYPT_INTO", False)
    sealed = sealed_block()
    out = bytearray(len(PLAINTEXT))
    assert bytes(SEALER.open_into("alpha", "m", DIGEST, sealed, out)) == PLAINTEXT  # control
    tampered = bytearray(sealed)
    tampered[-1] ^= 0x01
    with pytest.raises(SealError):
        SEALER.open_into("alpha", "m", DIGEST, bytes(tampered), out)
    assert out == bytes(len(out))
