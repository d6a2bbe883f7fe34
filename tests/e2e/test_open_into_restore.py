"""The restore path's opening into a buffer the agent owns, against a real server.

Sealed blocks stored through the real server are read back as views over every
transport (`iter_views`, the restore path's zero-copy iterator) and opened with
`BlockSealer.open_into` into one reused buffer, then decoded: the blocks that were
saved. A block altered before it was stored (the store cannot tell) is refused with
SealError and leaves that buffer zeroed, not holding the previous block or the
altered one's unverified plaintext."""

from __future__ import annotations

import os

import pytest
import torch

from policy.sealing import BlockSealer, SealError, opened_bytes
from replica_agent import codec
from replica_agent.spec import ModelSpec
from tests.support.servers import Running

SPEC = ModelSpec(
    "e2e/open-into",
    "r1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
    dtype="float32",
    block_tokens=16,
)
MODEL = SPEC.wire_model()


def test_blocks_open_into_one_reused_buffer_and_a_tampered_one_leaves_it_zeroed(
    tenant_server: Running, sealer: BlockSealer, transport: str
) -> None:
    client = tenant_server.client("a", transport=transport)
    tensors = [torch.randn(SPEC.block_shape) for _ in range(3)]
    digests = [os.urandom(32) for _ in tensors]
    sealed = [
        sealer.seal("alpha", MODEL, d, codec.encode_block(SPEC, t))
        for d, t in zip(digests, tensors, strict=True)
    ]
    bad_digest = os.urandom(32)
    bad = bytearray(sealer.seal("alpha", MODEL, bad_digest, codec.encode_block(SPEC, tensors[1])))
    bad[len(bad) // 2] ^= 0x01  # one ciphertext bit: the tag no longer verifies
    assert all(client.put("alpha", MODEL, [*digests, bad_digest], [*sealed, bytes(bad)]))

    out = bytearray(opened_bytes(sealed[0]))
    restored = []
    for digest, view in zip(
        digests, client.iter_views("alpha", MODEL, digests), strict=True
    ):  # control: every saved block opens and decodes as it was saved
        plain = sealer.open_into("alpha", MODEL, digest, view, out)
        assert plain.obj is out
        restored.append(codec.decode_block(SPEC, plain))
    assert all(torch.equal(r, t) for r, t in zip(restored, tensors, strict=True))

    [view] = client.iter_views("alpha", MODEL, [bad_digest])
    with pytest.raises(SealError):
        sealer.open_into("alpha", MODEL, bad_digest, view, out)
    assert out == bytes(len(out))  # neither the last good block nor unverified plaintext
    client.close()
