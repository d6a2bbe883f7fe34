"""The agent's GPU path on a real GPU: the scenarios the simulated copy engine runs in the
default suite (tests/unit/replica_agent/test_device_sim.py), here with real streams, events, pinned
memory and copy engines. Marked `gpu`: skipped where CUDA is absent.

Blocks are 2 MiB (bf16) or 4 MiB (fp32), and the consumer stream is held busy by a
spinning kernel (`torch.cuda._sleep`) before each restore, so a missing wait, a reused
network buffer or staging shared between threads shows up as wrong bytes; the negative
control proves that on this machine. Needs only torch and numpy: where the server's
dependencies are absent, the tests that start a server skip. Run it (with the rest of
the GPU check) through `scripts/gpu_check.py`, or alone with

    python -m pytest --confcutdir tests/e2e tests/e2e/test_gpu_restore.py

(`--confcutdir` keeps tests/conftest.py, which imports the server, from loading.)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
import torch

from kvshare.gpucheck.scenarios import (
    CudaRig,
    WaitsDropped,
    blocks_of,
    concurrent_restores,
    side_stream_snapshot,
    stalled_restore,
)
from replica_agent.device import BlockRestorer
from replica_agent.spec import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LARGE = {
    "bfloat16": ModelSpec("gpu/check", "r", 32, 8, 128, "bfloat16", block_tokens=16),
    "float32": ModelSpec("gpu/check", "r", 32, 8, 128, "float32", block_tokens=16),
}
STALL_S = 0.05


def _server_importable() -> bool:
    try:
        importlib.import_module("cacheserver.embedded")
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def rig() -> Iterator[CudaRig]:
    yield CudaRig("cuda")
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("stall_s", [0.0, STALL_S], ids=["idle", "stalled"])
def test_a_restore_under_a_stalled_stream_from_a_reused_buffer_is_exact(
    rig: CudaRig, dtype: str, stall_s: float
) -> None:
    restorer = BlockRestorer(LARGE[dtype], "cuda", ops=rig)
    assert restorer.device.index is not None  # named explicitly, never bare "cuda"
    for seed in range(3):
        outcome = stalled_restore(rig, restorer, count=8, stall_s=stall_s, seed=seed)
        assert outcome.as_dict() == {"blocks": 8, "wrong": 0, "foreign": 0}
    assert restorer.staging is not None and restorer.staging.rings_made == 1
    slots = restorer.staging._free[0].slots
    assert all(slot.buffer.is_pinned() for slot in slots)


def test_negative_control_this_gpu_shows_a_removed_staging_wait(rig: CudaRig) -> None:
    unsafe = BlockRestorer(LARGE["bfloat16"], "cuda", ops=WaitsDropped(rig, "synchronize"))
    outcome = stalled_restore(rig, unsafe, count=8, stall_s=STALL_S)
    assert outcome.wrong >= 4


@pytest.mark.parametrize("threads", [2, 4])
def test_concurrent_restores_on_one_restorer_never_mix_callers_blocks(
    rig: CudaRig, threads: int
) -> None:
    restorer = BlockRestorer(LARGE["bfloat16"], "cuda", ops=rig)
    for _ in range(3):
        outcomes = concurrent_restores(rig, restorer, threads=threads, count=8, stall_s=0.02)
        assert [o.as_dict() for o in outcomes] == [
            {"blocks": 8, "wrong": 0, "foreign": 0}
        ] * threads


def test_a_snapshot_waits_for_the_producers_side_stream(rig: CudaRig) -> None:
    outcome = side_stream_snapshot(rig, rig, rig.device, count=4, stall_s=STALL_S)
    assert outcome.as_dict() == {"blocks": 4, "wrong": 0, "foreign": 0}


def test_a_partial_restore_frees_the_rest(rig: CudaRig) -> None:
    spec = LARGE["bfloat16"]
    restorer = BlockRestorer(spec, "cuda", ops=rig)
    from replica_agent.codec import encode_block

    payloads = [encode_block(spec, b) for b in blocks_of(spec, 3, seed=4)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out, restored = restorer.restore(iter(payloads), 16)
    torch.cuda.synchronize()
    assert restored.blocks == 3 and out.shape[0] == 3
    assert torch.cuda.memory_allocated() - before == 3 * spec.block_payload_bytes


@pytest.mark.skipif(not _server_importable(), reason="the server's dependencies are absent")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_transformers_adapter_restores_on_the_gpu(dtype: str) -> None:
    pytest.importorskip("transformers")
    from kvshare.gpucheck.hf_roundtrip import restored_matches_recompute

    result = restored_matches_recompute(dtype, "cuda")
    assert result["blocks"] == result["asked"] and result["tokens_equal"], result
