"""Writes sealed_blocks.json: known-answer vectors for sealed block payloads (docs/design.md §3).

Run by hand only when the sealing format changes on purpose (and bump its format
byte and labels): `python tests/vectors/make_sealed_blocks.py`. The layout is packed
here from the description in `policy/sealing.py`, without importing it:

    "KVSL" | format u8 (1) | key_version u32 BE | nonce (24 bytes) | AES-256-GCM(ciphertext || tag)
    subkey = HMAC-SHA256(data_key, enc("kvshare/seal/subkey/v1", nonce[:12]))
    GCM nonce = nonce[12:]; associated data = enc("kvshare/seal/v1", tenant, model, digest, version)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvcommon.encoding import enc

OUTPUT = Path(__file__).with_name("sealed_blocks.json")


def seal(
    key: bytes, version: int, nonce: bytes, tenant: str, model: str, digest: bytes, plaintext: bytes
) -> bytes:
    subkey = hmac.new(key, enc("kvshare/seal/subkey/v1", nonce[:12]), hashlib.sha256).digest()
    ad = enc("kvshare/seal/v1", tenant, model, digest, version)
    body = AESGCM(subkey).encrypt(nonce[12:], plaintext, ad)
    return struct.pack(">4sBI", b"KVSL", 1, version) + nonce + body


def case(
    name: str,
    key: bytes,
    version: int,
    nonce: bytes,
    tenant: str,
    model: str,
    digest: bytes,
    plaintext: bytes,
) -> Any:
    return {
        "name": name,
        "key_hex": key.hex(),
        "key_version": version,
        "nonce_hex": nonce.hex(),
        "tenant": tenant,
        "model": model,
        "digest_hex": digest.hex(),
        "plaintext_hex": plaintext.hex(),
        "sealed_hex": seal(key, version, nonce, tenant, model, digest, plaintext).hex(),
    }


def main() -> None:
    key = bytes(range(32))
    key2 = hashlib.sha256(b"version 2").digest()
    nonce = bytes(range(100, 124))
    model = "kvshare/tiny-llama@seed0;fp32;L8;H4;D64;B4;tp0/1"
    digest = hashlib.sha256(b"block 0").digest()
    block = b"KVSBLOCK" + bytes(56) + bytes(range(256)) * 4
    cases = [
        case("alpha v1", key, 1, nonce, "alpha", model, digest, block),
        case("beta: same key bytes, another tenant", key, 1, nonce, "beta", model, digest, block),
        case("alpha v2", key2, 2, nonce, "alpha", model, digest, block),
        case("another nonce", key, 1, bytes(24), "alpha", model, digest, block),
        case("empty plaintext", key, 1, nonce, "alpha", model, digest, b""),
        case("one byte", key, 1, nonce, "alpha", "m", bytes(32), b"\x00"),
    ]
    OUTPUT.write_text(json.dumps({"format": "KVSL/1", "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
