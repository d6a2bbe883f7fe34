"""Writes storage_names.json: known-answer vectors for keyed block names (docs/design.md §3).

Run by hand only when the naming scheme changes on purpose (and bump its label):
`python tests/vectors/make_storage_names.py`. HKDF (RFC 5869) and the HMAC are
written out here with `hmac`/`hashlib`, without `policy.naming` or `cryptography`, so
the test compares two independent readings of the design:

    k_name = HKDF-SHA256(server_secret, salt = none, info = enc("kvshare/name/v1", tenant, epoch))
    name   = HMAC-SHA256(k_name, enc(model, digest))
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

from kvcommon.encoding import enc

OUTPUT = Path(__file__).with_name("storage_names.json")


def hkdf_sha256(ikm: bytes, info: bytes, length: int = 32) -> bytes:
    prk = hmac.new(b"\x00" * 32, ikm, hashlib.sha256).digest()  # no salt: HashLen zeros
    okm, block, counter = b"", b"", 1
    while len(okm) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        okm += block
        counter += 1
    return okm[:length]


def case(name: str, secret: bytes, tenant: str, epoch: int, model: str, digest: bytes) -> Any:
    naming_key = hkdf_sha256(secret, enc("kvshare/name/v1", tenant, epoch))
    storage = hmac.new(naming_key, enc(model, digest), hashlib.sha256).digest()
    return {
        "name": name,
        "server_secret_hex": secret.hex(),
        "tenant": tenant,
        "epoch": epoch,
        "model": model,
        "digest_hex": digest.hex(),
        "naming_key_hex": naming_key.hex(),
        "storage_name_hex": storage.hex(),
    }


def main() -> None:
    secret = bytes(range(32))
    other_secret = hashlib.sha256(b"another server").digest()
    model = "kvshare/tiny-llama@seed0;fp32;L8;H4;D64;B4;tp0/1"
    digest = hashlib.sha256(b"block 0").digest()
    cases = [
        case("alpha", secret, "alpha", 0, model, digest),
        case("beta: same digest, another tenant", secret, "beta", 0, model, digest),
        case("alpha after an epoch bump", secret, "alpha", 1, model, digest),
        case("another model", secret, "alpha", 0, model.replace("fp32", "bf16"), digest),
        case("another digest", secret, "alpha", 0, model, hashlib.sha256(b"block 1").digest()),
        case("another server secret", other_secret, "alpha", 0, model, digest),
        case("zero digest, shortest tenant", secret, "a", 0, "m", bytes(32)),
        case("large epoch", secret, "tenant.with-dots_1", 2**40, model, digest),
    ]
    OUTPUT.write_text(json.dumps({"scheme": "kvshare/name/v1", "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
