"""BlockSealer.opening: a sealed block opened as its bytes arrive, in pieces of any size,
gives exactly what `open` gives, with the same checks; a block that fails to open
leaves no plaintext in the caller's buffer, and feeding never raises (a reader keeps
its framing whatever the bytes say)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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
PLAINTEXT = os.urandom(64 * 1024 + 5)


def pieces(data: bytes, seed: int) -> Iterator[memoryview]:
    """`data` cut at random places (pieces of 1 byte to 20 KiB, some empty)."""
    rng = random.Random(seed)
    view, at = memoryview(data), 0
    while at < len(data):
        step = rng.choice((0, 1, 7, 16, 17, rng.randrange(1, 20_000)))
        yield view[at : at + step]
        at += step


def open_in_pieces(sealed: bytes, out: bytearray, seed: int, tenant: str = "alpha") -> memoryview:
    opening = SEALER.opening(tenant, "m", DIGEST, len(sealed), out)
    for piece in pieces(sealed, seed):
        opening.feed(piece)
    return opening.finish()


@pytest.mark.parametrize("seed", range(6))
def test_any_cut_of_the_block_opens_to_what_open_gives(seed: int) -> None:
    sealed = SEALER.seal("alpha", "m", DIGEST, PLAINTEXT)
    out = bytearray(len(PLAINTEXT) + 3)
    opened = open_in_pieces(sealed, out, seed)
    assert bytes(opened) == SEALER.open("alpha", "m", DIGEST, sealed) == PLAINTEXT
    assert opened.obj is out  # a view of the caller's buffer
    assert out[len(PLAINTEXT) :] == bytes(3)


@pytest.mark.parametrize("case", SEALED, ids=lambda c: c["name"])
def test_the_known_answer_vectors_open_in_pieces(case: dict[str, Any]) -> None:
    keys = TenantKeys({case["key_version"]: bytes.fromhex(case["key_hex"])})
    sealer = BlockSealer(Keyring({case["tenant"]: keys}))
    sealed = bytes.fromhex(case["sealed_hex"])
    out = bytearray(opened_bytes(sealed))
    opening = sealer.opening(
        case["tenant"], case["model"], bytes.fromhex(case["digest_hex"]), len(sealed), out
    )
    for piece in pieces(sealed, 1):
        opening.feed(piece)
    assert bytes(opening.finish()) == bytes.fromhex(case["plaintext_hex"])


def test_a_tampered_block_fails_at_finish_and_leaves_no_plaintext() -> None:
    sealed = SEALER.seal("alpha", "m", DIGEST, PLAINTEXT)
    out = bytearray(len(PLAINTEXT))
    assert bytes(open_in_pieces(sealed, out, 0)) == PLAINTEXT  # positive control
    where_all = (0, 5, HEADER_BYTES - 1, HEADER_BYTES, len(sealed) // 2, len(sealed) - 1)
    for where in where_all:  # magic, version, nonce, ciphertext, tag
        tampered = bytearray(sealed)
        tampered[where] ^= 0x01
        out[:] = b"\xaa" * len(out)
        with pytest.raises(SealError, match=r"^block cannot be opened$"):
            open_in_pieces(bytes(tampered), out, where)
        # Decrypted into `out` before the tag was checked, or never: nothing is left.
        assert out == bytes(len(out)) or out == b"\xaa" * len(out)
        assert b"\xaa" not in out or where < HEADER_BYTES  # a good header: all zeroed


def test_another_name_or_tenant_does_not_open() -> None:
    sealed = SEALER.seal("alpha", "m", DIGEST, PLAINTEXT)
    out = bytearray(len(PLAINTEXT))
    with pytest.raises(SealError):
        open_in_pieces(sealed, out, 2, tenant="beta")  # the same key, another tenant
    for model, digest in (("m2", DIGEST), ("m", os.urandom(32))):
        opening = SEALER.opening("alpha", model, digest, len(sealed), out)
        opening.feed(sealed)
        with pytest.raises(SealError):
            opening.finish()
    assert out == bytes(len(out))


@pytest.mark.parametrize("cut", [-1, +1, -TAG_BYTES, -(len(PLAINTEXT) + TAG_BYTES)])
def test_a_short_or_long_block_fails_without_raising_while_fed(cut: int) -> None:
    sealed = SEALER.seal("alpha", "m", DIGEST, PLAINTEXT)
    fed = sealed[:cut] if cut < 0 else sealed + os.urandom(cut)
    out = bytearray(len(PLAINTEXT))
    opening = SEALER.opening("alpha", "m", DIGEST, len(sealed), out)
    for piece in pieces(fed, 3):
        opening.feed(piece)  # never raises: the reader keeps its framing
    with pytest.raises(SealError):
        opening.finish()
    assert out == bytes(len(out))


def test_a_plaintext_longer_than_the_buffer_is_refused_untouched() -> None:
    sealed = SEALER.seal("alpha", "m", DIGEST, PLAINTEXT)
    out = bytearray(b"\xaa" * (len(PLAINTEXT) - 1))
    with pytest.raises(SealError):
        open_in_pieces(sealed, out, 4)
    assert out == b"\xaa" * len(out)  # nothing was written


def test_a_read_only_buffer_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="read-only"):
        SEALER.opening("alpha", "m", DIGEST, 100, memoryview(bytes(100)))
