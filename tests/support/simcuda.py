"""A simulated asynchronous copy engine: the agent's CUDA code paths, run on the CPU.

`SimCuda` implements `replica_agent.device_ops.DeviceOps`; the restorer and the save
snapshots take it in place of `CudaOps` and run their CUDA branch unchanged. What it
models, because that is what makes a missing wait visible:

- each stream is a FIFO; one engine thread runs the head of a ready stream, streams
  interleaved in a seeded random order; each operation takes a little time, and a copy
  runs late: not before `copy_lag_s` after it was queued (kernels run soon after);
- a copy reads its source when it runs, not when it is queued, so a host buffer
  rewritten too early gives the copy the new bytes;
- `wait(stream, event)` holds everything queued on that stream after it until the
  event happened; streams never synchronise implicitly (PyTorch's side streams are
  non-blocking), so a missing wait is a race the engine's random order exposes;
- device memory is fresh CPU memory filled with a poison byte (what an allocator hands
  out: someone's old bytes), counted, with an optional limit that raises
  `torch.OutOfMemoryError`; `device_of` knows which tensors are "device" tensors;
- `capture()` marks a thread as capturing a CUDA graph in global mode: any operation
  from another thread meanwhile, or from the capturing thread other than asking whether
  it captures, is recorded in `violations` and raises (CUDA would refuse it, or put it
  into the engine's graph).

Not modelled: the caching allocator's reuse of freed blocks (`record_stream` is only
counted), bandwidth, several copy engines. The helpers `launch`, `stall`, `read` and
`use_stream` are what tests use to play an engine: kernels on streams, a busy stream,
a read ordered on a stream, `with torch.cuda.stream(s)`.
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from replica_agent.device_ops import Event, Stream

POISON = 0xA5
DEVICE = torch.device("cuda", 0)


class SimEvent:
    def __init__(self) -> None:
        self.happened = threading.Event()


@dataclass
class _Op:
    run: Callable[[], object] | None = None  # a copy or kernel; what it returns is dropped
    after: SimEvent | None = None  # a wait: runnable once this happened
    stall_s: float = 0.0  # a busy stream: done this long after it reached the head
    instant: bool = False  # an event record: no copy-engine time
    not_before: float = 0.0  # a copy runs late: not before this (monotonic seconds)
    started: float | None = None


@dataclass
class SimStream:
    name: str
    device: torch.device
    queue: deque[_Op] = field(default_factory=deque)


class SimCuda:
    device = DEVICE  # the rig's device, as CudaRig has

    def __init__(
        self,
        *,
        op_delay_s: float = 0.0003,
        copy_lag_s: float = 0.003,
        seed: int = 0,
        device_bytes_limit: int | None = None,
    ) -> None:
        self.op_delay_s = op_delay_s
        self.copy_lag_s = copy_lag_s
        self.device_bytes_limit = device_bytes_limit
        self._rng = random.Random(seed)
        self._changed = threading.Condition()
        self._streams: list[SimStream] = []
        self._defaults: dict[torch.device, SimStream] = {}
        self._local = threading.local()
        self._device_storages: dict[int, tuple[torch.device, int]] = {}
        self._capturing: set[int] = set()
        self.callers: set[str] = set()  # names of threads that called a device operation
        self.violations: list[str] = []
        self.errors: list[BaseException] = []
        self.kept_alive = 0
        self.peak_device_bytes = 0  # high-water mark; tests may reset it
        self.host_bytes = 0
        self._closed = False
        self._engine = threading.Thread(target=self._run, name="sim-copy-engine", daemon=True)
        self._engine.start()

    # -- DeviceOps ----------------------------------------------------------------------

    def resolve(self, device: torch.device | str) -> torch.device:
        resolved = torch.device(device)
        if resolved.type == "cuda" and resolved.index is None:
            return DEVICE
        return resolved

    def device_of(self, tensor: torch.Tensor) -> torch.device:  # no device call
        found = self._device_storages.get(tensor.untyped_storage().data_ptr())
        return found[0] if found else tensor.device

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, stream: Stream
    ) -> torch.Tensor:
        self._note_call(during_own_capture=0 in shape)  # no bytes: no allocation
        return self.device_tensor(shape, dtype, device)

    def empty_host(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self._note_call()
        self.host_bytes += nbytes
        return torch.full((nbytes,), POISON, dtype=torch.uint8)

    def new_stream(self, device: torch.device) -> Stream:
        self._note_call()
        with self._changed:
            stream = SimStream(f"stream{len(self._streams)}", device)
            self._streams.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> Stream:
        self._note_call(during_own_capture=True)  # a lookup, allowed in a capture
        stack: list[SimStream] = getattr(self._local, "streams", [])
        for stream in reversed(stack):
            if stream.device == device:
                return stream
        return self.default_stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> None:
        self._note_call()
        late = time.monotonic() + self.copy_lag_s
        self._queue(stream, _Op(run=lambda: dst.copy_(src), not_before=late))

    def record(self, stream: Stream) -> Event:
        self._note_call()
        event = SimEvent()
        self._queue(stream, _Op(run=event.happened.set, instant=True))
        return event

    def wait(self, stream: Stream, event: Event) -> None:
        self._note_call()
        assert isinstance(event, SimEvent)
        self._queue(stream, _Op(after=event))

    def synchronize(self, event: Event) -> None:
        self._note_call()
        assert isinstance(event, SimEvent)
        if not event.happened.wait(timeout=60):
            raise RuntimeError("simulated event never happened: a wait cycle?")

    def query(self, event: Event) -> bool:
        self._note_call()
        assert isinstance(event, SimEvent)
        return event.happened.is_set()

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        self._note_call()
        self.kept_alive += 1  # the queued copy's closure holds the tensor until it runs

    def is_capturing(self, device: torch.device) -> bool:
        self._note_call(during_own_capture=True)
        return threading.get_ident() in self._capturing

    # -- playing the engine ---------------------------------------------------------------

    def default_stream(self, device: torch.device = DEVICE) -> SimStream:
        with self._changed:
            stream = self._defaults.get(device)
            if stream is None:
                stream = self._defaults[device] = SimStream(f"default:{device}", device)
                self._streams.append(stream)
            return stream

    def device_tensor(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device = DEVICE
    ) -> torch.Tensor:
        """Poison-filled "device" memory, counted (and limited)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        limit = self.device_bytes_limit
        if limit is not None and self.device_bytes() + nbytes > limit:
            raise torch.OutOfMemoryError(f"simulated: {nbytes} bytes more would exceed {limit}")
        array = np.full(max(nbytes, 1), POISON, dtype=np.uint8)
        pointer = array.ctypes.data
        with self._changed:
            self._device_storages[pointer] = (device, nbytes)
            total = sum(size for _, size in self._device_storages.values())
            self.peak_device_bytes = max(self.peak_device_bytes, total)
        weakref.finalize(array, self._freed, pointer)
        return torch.from_numpy(array)[:nbytes].view(dtype).view(tuple(shape))

    def device_bytes(self) -> int:
        with self._changed:
            return sum(nbytes for _, nbytes in self._device_storages.values())

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host  # a kernel's constant input: already where the "kernel" runs

    def launch(self, stream: Stream, kernel: Callable[[], object]) -> None:
        """A kernel: `kernel` runs on the engine, in `stream`'s order."""
        self._queue(stream, _Op(run=kernel))

    def stall(self, stream: Stream, seconds: float) -> None:
        """Keep `stream` busy for `seconds` (a long kernel)."""
        self._queue(stream, _Op(stall_s=seconds))

    def read(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        """`tensor`'s bytes as work on `stream` sees them (after what is queued there)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        self.launch(stream, lambda: host.copy_(tensor))
        done = SimEvent()
        self._queue(stream, _Op(run=done.happened.set, instant=True))
        if not done.happened.wait(timeout=60):
            raise RuntimeError("simulated read never ran: a wait cycle?")
        return host

    @contextmanager
    def use_stream(self, stream: Stream) -> Iterator[None]:
        """`with torch.cuda.stream(stream)` for this thread."""
        assert isinstance(stream, SimStream)
        stack = self._local.__dict__.setdefault("streams", [])
        stack.append(stream)
        try:
            yield
        finally:
            stack.pop()

    @contextmanager
    def capture(self) -> Iterator[None]:
        """This thread captures a CUDA graph (global mode) while the block runs."""
        self._capturing.add(threading.get_ident())
        try:
            yield
        finally:
            self._capturing.discard(threading.get_ident())

    def drain(self, timeout_s: float = 60) -> None:
        """Wait until every stream is empty."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while any(s.queue for s in self._streams):
                if not self._changed.wait(max(deadline - time.monotonic(), 0)):
                    raise RuntimeError("simulated streams did not drain: a wait cycle?")

    def close(self) -> None:
        self.drain()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._engine.join()
        if self.errors:
            raise self.errors[0]

    # -- the engine -----------------------------------------------------------------------

    def _note_call(self, *, during_own_capture: bool = False) -> None:
        """Record the caller; a call CUDA would refuse (or capture into the graph) while
        a capture is underway is recorded in `violations` and raises."""
        me = threading.get_ident()
        name = threading.current_thread().name
        self.callers.add(name)
        if self._capturing - {me}:
            message = f"{name} called the device during another thread's capture"
        elif me in self._capturing and not during_own_capture:
            message = f"{name} called the device while capturing a graph"
        else:
            return
        self.violations.append(message)
        raise RuntimeError(f"operation not permitted when stream is capturing ({message})")

    def _queue(self, stream: Stream, op: _Op) -> None:
        assert isinstance(stream, SimStream)
        with self._changed:
            stream.queue.append(op)
            self._changed.notify_all()

    def _freed(self, pointer: int) -> None:
        with self._changed:
            self._device_storages.pop(pointer, None)

    def _run(self) -> None:
        while True:
            with self._changed:
                while True:
                    if self._closed:
                        return
                    ready, wake_at = self._ready_streams(time.monotonic())
                    if ready:
                        break
                    self._changed.wait(0.05 if wake_at is None else wake_at - time.monotonic())
                stream = self._rng.choice(ready)
                op = stream.queue[0]
                delay = self._rng.uniform(0.5, 1.5) * self.op_delay_s
            if op.run is not None:
                if not op.instant:
                    time.sleep(delay)  # one copy engine: work ops run one at a time, late
                try:
                    op.run()
                except BaseException as error:  # surfaced by close()
                    self.errors.append(error)
            with self._changed:
                stream.queue.popleft()
                # A finished copy lets go of its tensors before anyone can see it done:
                # after `drain` or an event, `device_bytes` no longer counts them.
                del op
                self._changed.notify_all()

    def _ready_streams(self, now: float) -> tuple[list[SimStream], float | None]:
        """Streams whose head can run now, and when a stalled head will be done."""
        ready, wake_at = [], None
        for stream in self._streams:
            if not stream.queue:
                continue
            op = stream.queue[0]
            if op.after is not None and not op.after.happened.is_set():
                continue
            if now < op.not_before:
                wake_at = op.not_before if wake_at is None else min(wake_at, op.not_before)
                continue
            if op.stall_s:
                op.started = now if op.started is None else op.started
                if now < op.started + op.stall_s:
                    done_at = op.started + op.stall_s
                    wake_at = done_at if wake_at is None else min(wake_at, done_at)
                    continue
            ready.append(stream)
        return ready, wake_at
