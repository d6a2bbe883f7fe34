"""The CUDA restore path: pinned staging, non-blocking copies, device placement.

Marked `gpu`: skipped on machines without CUDA (the CI machines), run where one is lent.
"""

from __future__ import annotations

import pytest
import torch

from replica_agent.codec import encode_block
from replica_agent.device import BlockRestorer
from replica_agent.spec import ModelSpec

pytestmark = pytest.mark.gpu
SPEC = ModelSpec(
    model_id="t/m",
    revision="r",
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    dtype="bfloat16",
    block_tokens=64,
)


def test_blocks_land_on_the_device_bit_exact_through_pinned_staging() -> None:
    restorer = BlockRestorer(SPEC, "cuda")
    assert all(buffer.is_pinned() for buffer in restorer._staging)
    kv = [torch.randn(SPEC.block_shape).to(torch.bfloat16) for _ in range(5)]
    restored = restorer.restore(iter([encode_block(SPEC, b) for b in kv]), 5)
    assert restored.device.type == "cuda" and restored.shape == (5, *SPEC.block_shape)
    for got, want in zip(restored.cpu(), kv, strict=True):
        assert torch.equal(got, want)


def test_staging_is_reused_across_calls() -> None:
    restorer = BlockRestorer(SPEC, "cuda")
    pointers = [b.data_ptr() for b in restorer._staging]
    kv = torch.randn(SPEC.block_shape).to(torch.bfloat16)
    for _ in range(3):
        restorer.restore(iter([encode_block(SPEC, kv)] * 4), 4)
    assert [b.data_ptr() for b in restorer._staging] == pointers
