"""The device operations the restore and save paths use: one small interface, two homes.

`CudaOps` runs them on CUDA. Tests run the very same restore and save code against a
simulated asynchronous copy engine (tests/support/simcuda.py) that implements this interface:
its copies run late, in order per stream, and read their source only when they run, so
a missing wait shows up as wrong bytes on a CPU-only machine.

The rules the callers keep, and that make the paths correct on a real GPU:
- a host buffer that a queued copy reads is not written until that copy's event is done;
- work on stream B that needs stream A's results is queued after `wait(B, record(A))`,
  a device-side wait: the host does not block;
- a device tensor read on a stream other than the one it was allocated on is marked with
  `keep_alive(tensor, stream)` (`record_stream`), so the caching allocator does not give
  its memory to new work before that stream has read it;
- every call names its device explicitly (`torch.device("cuda")` means "the current
  device of the calling thread", which differs between threads and ranks);
- only the engine's own threads call these: the saver thread never touches CUDA, so an
  engine's CUDA graph capture is never disturbed by background work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch

if TYPE_CHECKING:
    import torch.distributed as dist


class Stream(Protocol):
    """An opaque handle to a queue of device work (a `torch.cuda.Stream` on CUDA)."""


class Event(Protocol):
    """An opaque marker recorded on a stream (a `torch.cuda.Event` on CUDA)."""


class DeviceOps(Protocol):
    def resolve(self, device: torch.device | str) -> torch.device:
        """`device` with an explicit index (`cuda` -> `cuda:<current device>`)."""
        ...

    def device_of(self, tensor: torch.Tensor) -> torch.device: ...

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stream: Stream
    ) -> torch.Tensor:
        """Device memory for work on `stream`; raises `torch.OutOfMemoryError` when full."""
        ...

    def empty_host(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Pinned (page-locked) host bytes for copies to and from `device`."""
        ...

    def new_stream(self, device: torch.device) -> Stream: ...

    def current_stream(self, device: torch.device) -> Stream:
        """The calling thread's current stream on `device` (the engine's compute stream)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        """Queue `dst <- src` on `stream`; it reads `src` only when it runs."""
        ...

    def record(self, stream: Stream) -> Event: ...

    def wait(self, stream: Stream, event: Event) -> None:
        """Work queued on `stream` from now on runs after `event` (no host wait)."""
        ...

    def synchronize(self, event: Event) -> None:
        """Block the calling thread until `event` has happened."""
        ...

    def query(self, event: Event) -> bool: ...

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None: ...

    def is_capturing(self, device: torch.device) -> bool:
        """Whether the calling thread is capturing a CUDA graph on `device`."""
        ...


class CudaOps:
    """`DeviceOps` on CUDA through torch."""

    def resolve(self, device: torch.device | str) -> torch.device:
        resolved = torch.device(device)
        if resolved.type == "cuda" and resolved.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return resolved

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stream: Stream
    ) -> torch.Tensor:
        with torch.cuda.stream(_cuda(stream)):
            return torch.empty(tuple(shape), dtype=dtype, device=device)

    def empty_host(self, nbytes: int, device: torch.device) -> torch.Tensor:
        # Under the device: pinning creates a context on the *current* device, which
        # would be GPU 0 for every rank of a torchrun job without CUDA_VISIBLE_DEVICES.
        with torch.cuda.device(device):
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_stream(self, device: torch.device) -> Stream:
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: torch.device) -> Stream:
        return torch.cuda.current_stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        with torch.cuda.stream(_cuda(stream)):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Stream) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(_cuda(stream))
        return cast(Event, event)

    def wait(self, stream: Stream, event: Event) -> None:
        _cuda(stream).wait_event(cast(torch.cuda.Event, event))

    def synchronize(self, event: Event) -> None:
        cast(torch.cuda.Event, event).synchronize()

    def query(self, event: Event) -> bool:
        return bool(cast(torch.cuda.Event, event).query())  # type: ignore[no-untyped-call]

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(_cuda(stream))

    def is_capturing(self, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        with torch.cuda.device(device):
            return bool(torch.cuda.is_current_stream_capturing())


def _cuda(stream: Stream) -> torch.cuda.Stream:
    return cast(torch.cuda.Stream, stream)


def resolve_device(device: torch.device | str, ops: DeviceOps | None = None) -> torch.device:
    """`device` with an explicit index; CPU devices need no CUDA."""
    resolved = torch.device(device)
    if resolved.type != "cuda":
        return resolved
    return (ops or CudaOps()).resolve(resolved)


def min_across_ranks(
    group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> Callable[[int], int]:
    """A `tp_agree` for `ReplicaAgent`: the smallest count over the ranks of `group`.

    Every rank of a tensor-parallel group must use the same number of restored blocks
    (each holds a shard of the same tokens). `device`: where the collective's one-element
    tensor lives (`cuda:<local rank>` for NCCL, `cpu` for gloo).
    """
    import torch.distributed as dist  # only for tensor-parallel replicas

    def agree(count: int) -> int:
        value = torch.tensor([count], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        return int(value.item())

    return agree
