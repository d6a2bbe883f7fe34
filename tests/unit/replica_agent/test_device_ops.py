"""CudaOps names its device explicitly, without a GPU: torch.cuda's entry points are
replaced by recorders, and the assertions are about which device each call was made
under. `min_across_ranks` runs as a real two-rank gloo group on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from replica_agent.device_ops import CudaOps, resolve_device
from tests.support.repo import REPO


class CurrentDevice:
    """Stand-in for torch.cuda's per-thread current device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, index: int) -> None:
        self.index = index
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.index)
        monkeypatch.setattr(torch.cuda, "device", self.switched)

    @contextmanager
    def switched(self, device: torch.device) -> Iterator[None]:
        before, self.index = self.index, torch.device(device).index
        try:
            yield
        finally:
            self.index = before


def test_cuda_means_the_callers_current_device_named_explicitly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    CurrentDevice(monkeypatch, 3)
    assert CudaOps().resolve("cuda") == torch.device("cuda", 3)
    assert CudaOps().resolve("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 3)


def test_a_cpu_device_needs_no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cuda() -> int:
        raise AssertionError("CUDA was asked about a CPU device")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    assert resolve_device("cpu") == torch.device("cpu")
    assert not CudaOps().is_capturing(torch.device("cpu"))


def test_pinned_memory_is_allocated_under_the_device_it_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pinning creates a CUDA context on the current device: under torchrun without
    CUDA_VISIBLE_DEVICES every rank would land on GPU 0 unless the device is entered."""
    current = CurrentDevice(monkeypatch, 0)
    allocations: list[tuple[int, bool]] = []
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        allocations.append((current.index, pin_memory))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    buffer = CudaOps().empty_host(128, torch.device("cuda", 2))
    assert allocations == [(2, True)] and buffer.dtype == torch.uint8 and buffer.numel() == 128
    assert current.index == 0  # the caller's device is left as it was


def test_capture_is_asked_about_the_named_device(monkeypatch: pytest.MonkeyPatch) -> None:
    current = CurrentDevice(monkeypatch, 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: current.index == 1)
    assert CudaOps().is_capturing(torch.device("cuda", 1))
    assert not CudaOps().is_capturing(torch.device("cuda", 0))


RANK_MAIN = """
import sys
import torch.distributed as dist
from replica_agent.device_ops import min_across_ranks
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
agree = min_across_ranks()
print(agree([5, 3][rank]), agree([0, 7][rank]), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_min_across_ranks_gives_every_rank_the_smallest_count(tmp_path: Path) -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_MAIN, str(rank), str(tmp_path / "store")],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err for _, err in outputs]
    assert [out.split() for out, _ in outputs] == [["3", "0"], ["3", "0"]]
