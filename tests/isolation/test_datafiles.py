"""Scanning everything the server wrote finds no client digest, token or plaintext.

Positive controls in the same test: the scanner finds the sealed ciphertext (the data
is really on disk) and finds a block deliberately stored unsealed (the scanner can
see plaintext when it is there).
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

import pytest
import torch

from kvcommon.errors import PermissionDenied, Unauthenticated
from policy.sealing import BlockSealer, Keyring, TenantKeys
from replica_agent import codec
from replica_agent.client import BlockClient
from replica_agent.spec import ModelSpec
from tests.conftest import read_allocated
from tests.isolation.conftest import isolation_config, serve

SPEC = ModelSpec(
    "iso/secret-model",
    "r1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    block_tokens=4,
)
MODEL = SPEC.wire_model()


def everything_written(data_dir: Path) -> bytes:
    return b"".join(read_allocated(p) for p in sorted(data_dir.rglob("*")) if p.is_file())


def forms(secret: bytes) -> list[bytes]:
    """The ways a digest or token could leak: raw, hex, base64."""
    return [secret, secret.hex().encode(), base64.b64encode(secret)]


def windows(plaintext: bytes, size: int = 24) -> list[bytes]:
    return [plaintext[i : i + size] for i in range(64, len(plaintext) - size, 97)]


def test_data_files_hold_no_digest_token_or_plaintext(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tenancy = isolation_config(tmp_path)
    sealer = BlockSealer(Keyring({"alpha": TenantKeys({1: os.urandom(32)})}))
    generator = torch.Generator().manual_seed(5)
    plaintexts = [
        codec.encode_block(SPEC, torch.randn(SPEC.block_shape, generator=generator))
        for _ in range(32)
    ]
    digests = [os.urandom(32) for _ in plaintexts]
    sealed = [sealer.seal("alpha", MODEL, d, p) for d, p in zip(digests, plaintexts, strict=True)]
    control_digest, control_plain = os.urandom(32), os.urandom(4096)
    running = serve(tenancy)
    try:
        with running.client("a") as a, running.client("b") as b:
            a.put("alpha", MODEL, digests, sealed)
            assert a.get("alpha", MODEL, digests) == sealed
            b.put("beta", MODEL, [control_digest], [control_plain])  # unsealed, on purpose
            near_miss = tenancy.tokens["a"][:-2] + "xx"  # would show if tokens were logged
            with BlockClient(running.address, near_miss) as wrong, pytest.raises(Unauthenticated):
                wrong.lookup("alpha", MODEL, digests[:1])
            with pytest.raises(PermissionDenied):  # audited as a denial
                b.get("alpha", MODEL, digests)
            a.delete("alpha", MODEL, digests[:2])
    finally:
        running.stop()
    written = everything_written(tenancy.path.parent / "data")
    # Positive controls: the ciphertext is there, and unsealed bytes would be seen.
    assert all(s[40:80] in written for s in sealed[2:])
    assert control_plain[1000:1024] in written
    secrets = [*digests, control_digest]
    secrets += [t.encode() for t in (*tenancy.tokens.values(), near_miss)]
    for secret in secrets:
        assert not any(form in written for form in forms(secret))
    assert codec.MAGIC not in written  # no plaintext block header anywhere
    assert not any(w in written for p in plaintexts for w in windows(p))
    assert MODEL.encode() not in written  # names are keyed: not even the model leaks
    logged = caplog.text.encode()
    assert not any(form in logged for s in secrets for form in forms(s))
