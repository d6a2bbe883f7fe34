"""Scenarios of the agent's GPU path, run against the simulated copy engine (the default
suite's tests/support/simcuda.py) and against a real GPU (scripts/gpu_check.py,
tests/e2e/test_gpu_restore.py).

A `Rig` is what a scenario needs to play an inference engine: device operations (the
restorer's `DeviceOps`), kernels on streams (`launch`), a busy stream (`stall`), a read
ordered on a stream (`read`: what the engine's next kernel would see), and
`use_stream` (`with torch.cuda.stream(s)`). `SimCuda` is a rig; `CudaRig` is the GPU one.

Block contents name their owner: every element of tenant t's block i is random, and a
restored block is "foreign" when it equals a block of another request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, cast

import torch

from replica_agent.codec import encode_block, torch_dtype
from replica_agent.device_ops import CudaOps, DeviceOps, Stream
from replica_agent.device_snapshot import HostPool, Snapshotter
from replica_agent.spec import ModelSpec

SMALL = ModelSpec(
    model_id="t/m",
    revision="r",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    block_tokens=4,
)


class Rig(Protocol):
    def launch(self, stream: Stream, kernel: Callable[[], object]) -> None: ...
    def stall(self, stream: Stream, seconds: float) -> None: ...
    def read(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor: ...
    def use_stream(self, stream: Stream) -> AbstractContextManager[None]: ...
    def upload(self, host: torch.Tensor) -> torch.Tensor: ...
    def device_tensor(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device = ...
    ) -> torch.Tensor: ...

    # DeviceOps, the parts scenarios call directly
    def new_stream(self, device: torch.device) -> Stream: ...
    def current_stream(self, device: torch.device) -> Stream: ...


class Restorer(Protocol):
    """What the restore scenarios call: `BlockRestorer`, or the pre-fix one in
    tests/support/sim_pre_fix_restorer.py."""

    spec: ModelSpec
    device: torch.device

    def restore(
        self, payloads: Iterable[bytes | memoryview], max_blocks: int, /
    ) -> tuple[torch.Tensor, object]: ...


class CudaRig(CudaOps):
    """The rig on a real GPU: `stall` spins a kernel (`torch.cuda._sleep`)."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = self.resolve(device)
        self._cycles_per_s = _calibrate_sleep(self.device)

    def launch(self, stream: Stream, kernel: Callable[[], object]) -> None:
        with torch.cuda.stream(_cuda(stream)):
            kernel()

    def stall(self, stream: Stream, seconds: float) -> None:
        with torch.cuda.stream(_cuda(stream)):
            _spin(int(seconds * self._cycles_per_s))

    def read(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(_cuda(stream)):
            host.copy_(tensor, non_blocking=True)
        self.synchronize(self.record(stream))
        return host

    def use_stream(self, stream: Stream) -> AbstractContextManager[None]:
        return torch.cuda.stream(_cuda(stream))

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device)

    def device_tensor(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | None = None
    ) -> torch.Tensor:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device or self.device)


def _cuda(stream: Stream) -> torch.cuda.Stream:
    return cast(torch.cuda.Stream, stream)  # what CudaOps hands out (replica_agent/device_ops.py)


def _spin(cycles: int) -> None:
    """A kernel that keeps the current stream busy for `cycles` GPU clock cycles."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # torch leaves _sleep unannotated


def _timing_event() -> torch.cuda.Event:
    # torch leaves Event.__new__ unannotated
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _calibrate_sleep(device: torch.device) -> float:
    with torch.cuda.device(device):
        start, end = _timing_event(), _timing_event()
        _spin(1000)  # warm
        start.record()
        _spin(10_000_000)
        end.record()
        end.synchronize()
        elapsed_ms: float = start.elapsed_time(end)  # torch leaves the return unannotated
        return 10_000_000 / (elapsed_ms / 1000)


class WaitsDropped:
    """The negative control: `ops` with some of its waits removed (the named methods do
    nothing), so a harness that cannot see a missing wait is caught passing."""

    def __init__(self, ops: DeviceOps, *dropped: str) -> None:
        self._ops, self._dropped = ops, set(dropped)

    def __getattr__(self, name: str) -> Any:
        if name in self._dropped:
            return lambda *args, **kwargs: None
        return getattr(self._ops, name)


def blocks_of(spec: ModelSpec, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(spec.block_shape, generator=generator).to(torch_dtype(spec))
        for _ in range(count)
    ]


def reused_buffer(payloads: Sequence[bytes]) -> Iterator[memoryview]:
    """Payloads as the bulk channel gives them: views of one buffer, rewritten for the
    next block as soon as the consumer asks for it."""
    buffer = bytearray(max(len(p) for p in payloads))
    for payload in payloads:
        buffer[: len(payload)] = payload
        yield memoryview(buffer)[: len(payload)]
    buffer[:] = bytes(len(buffer))


@dataclass(frozen=True)
class Outcome:
    blocks: int  # restored
    wrong: int  # restored blocks that differ from what was asked for
    foreign: int  # ... and equal a block of another request

    def as_dict(self) -> dict[str, int]:
        return {"blocks": self.blocks, "wrong": self.wrong, "foreign": self.foreign}


def judge(
    got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], others: Sequence[torch.Tensor]
) -> Outcome:
    wrong = [g for g, w in zip(got, want, strict=False) if not torch.equal(g, w)]
    foreign = [g for g in wrong if any(torch.equal(g, o) for o in others)]
    return Outcome(len(got), len(wrong), len(foreign))


def stalled_restore(
    rig: Rig,
    restorer: Restorer,
    *,
    count: int = 8,
    stall_s: float = 0.02,
    seed: int = 1,
) -> Outcome:
    """One restore while the consumer stream is busy, from a reused network buffer."""
    spec = restorer.spec
    want = blocks_of(spec, count, seed)
    consumer = rig.current_stream(restorer.device)
    rig.stall(consumer, stall_s)
    out, _ = restorer.restore(reused_buffer([encode_block(spec, b) for b in want]), count)
    got = rig.read(out, consumer)
    return judge(list(got), want, [])


def concurrent_restores(
    rig: Rig,
    restorer: Restorer,
    *,
    threads: int,
    count: int = 8,
    stall_s: float = 0.01,
) -> list[Outcome]:
    """`threads` callers restore their own blocks through one restorer at once, each on
    its own stream (a request per thread, as an engine's worker threads would)."""
    spec = restorer.spec
    wants = [blocks_of(spec, count, seed=100 + t) for t in range(threads)]
    payloads = [[encode_block(spec, b) for b in want] for want in wants]
    start = threading.Barrier(threads)
    outcomes: dict[int, Outcome] = {}
    failures: list[BaseException] = []

    def run(t: int) -> None:
        try:
            stream = rig.new_stream(restorer.device)
            with rig.use_stream(stream):
                start.wait()
                rig.stall(stream, stall_s)
                out, _ = restorer.restore(reused_buffer(payloads[t]), count)
                got = list(rig.read(out, stream))
            others = [b for u, want in enumerate(wants) if u != t for b in want]
            outcomes[t] = judge(got, wants[t], others)
        except BaseException as error:
            failures.append(error)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if failures:
        raise failures[0]
    return [outcomes[t] for t in range(threads)]


def side_stream_snapshot(
    rig: Rig, ops: DeviceOps, device: torch.device, *, count: int = 4, stall_s: float = 0.02
) -> Outcome:
    """A producer writes blocks on a side stream (late: the stream is busy) and saves them
    with that stream current: the snapshot must hold the produced bytes."""
    spec = SMALL
    want = blocks_of(spec, count, seed=7)
    producer = rig.new_stream(device)
    snapshots = Snapshotter(spec, ops, HostPool(spec, ops, device, 1 << 20))
    with rig.use_stream(producer):
        rig.stall(producer, stall_s)
        blocks = [rig.device_tensor(spec.block_shape, torch_dtype(spec), device) for _ in want]
        for block, values in zip(blocks, want, strict=True):
            source = rig.upload(values)
            rig.launch(producer, partial(block.copy_, source))
        snapshot = snapshots.take(blocks)
    assert not isinstance(snapshot, str), snapshot
    snapshots.wait(snapshot)
    got = [snapshots.pool.payload(buffer).clone() for buffer in snapshot.buffers]
    return judge(got, want, [])


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started
