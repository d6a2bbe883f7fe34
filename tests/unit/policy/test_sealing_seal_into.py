"""BlockSealer.seal_into: a block sealed into a buffer the caller owns and reuses, the
same bytes `seal` makes (the known-answer vectors), nothing written into a buffer that
cannot hold it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from policy import sealing
from policy.sealing import BlockSealer, Keyring, SealError, TenantKeys, sealed_bytes

VECTORS = Path(__file__).resolve().parents[2] / "vectors"
SEALED = json.loads((VECTORS / "sealed_blocks.json").read_text())["cases"]
KEY = os.urandom(32)
SEALER = BlockSealer(Keyring({"alpha": TenantKeys({1: KEY})}))
DIGEST = os.urandom(32)
PLAINTEXT = os.urandom(3 * 4096 + 5)


@pytest.mark.parametrize("case", SEALED, ids=lambda c: c["name"])
def test_seal_into_makes_the_known_answer_vectors(case: dict[str, Any]) -> None:
    keys = TenantKeys({case["key_version"]: bytes.fromhex(case["key_hex"])})
    sealer = BlockSealer(Keyring({case["tenant"]: keys}))
    plaintext = bytes.fromhex(case["plaintext_hex"])
    out = bytearray(sealed_bytes(len(plaintext)) + 7)  # room to spare: only the block is used
    sealed = sealer.seal_into(
        case["tenant"],
        case["model"],
        bytes.fromhex(case["digest_hex"]),
        memoryview(plaintext),
        out,
        nonce=bytes.fromhex(case["nonce_hex"]),
    )
    assert bytes(sealed) == bytes.fromhex(case["sealed_hex"])
    assert sealed.obj is out  # a view of the caller's buffer, not a copy
    assert out[sealed.nbytes :] == bytes(7)


def test_a_buffer_reused_for_each_block_seals_what_open_opens() -> None:
    out = bytearray(sealed_bytes(len(PLAINTEXT)))
    for _ in range(2):  # the same buffer again: a fresh nonce, the same plaintext back
        sealed = SEALER.seal_into("alpha", "m", DIGEST, PLAINTEXT, out)
        assert SEALER.open("alpha", "m", DIGEST, sealed) == PLAINTEXT
        with pytest.raises(SealError):  # bound like seal's: another digest does not open
            SEALER.open("alpha", "m", bytes(32), sealed)


def test_a_buffer_too_small_or_read_only_is_refused_before_anything_is_written() -> None:
    short = bytearray(b"\xaa" * (sealed_bytes(len(PLAINTEXT)) - 1))
    with pytest.raises(ValueError, match=r"needs \d+ \(sealed_bytes\); pass a larger buffer"):
        SEALER.seal_into("alpha", "m", DIGEST, PLAINTEXT, short)
    assert short == b"\xaa" * len(short)  # nothing written
    with pytest.raises(ValueError, match="read-only; pass a writable buffer"):
        SEALER.seal_into("alpha", "m", DIGEST, PLAINTEXT, memoryview(bytes(len(short) + 1)))


def test_without_encrypt_into_seal_into_encrypts_then_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cryptography releases in the declared range before AESGCM.encrypt_into."""
    monkeypatch.setattr(sealing, "ENCRYPT_INTO", False)
    nonce = os.urandom(24)
    out = bytearray(sealed_bytes(len(PLAINTEXT)))
    sealed = SEALER.seal_into("alpha", "m", DIGEST, PLAINTEXT, out, nonce=nonce)
    assert bytes(sealed) == SEALER.seal("alpha", "m", DIGEST, PLAINTEXT, nonce=nonce)
