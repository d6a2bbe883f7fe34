"""Save-time snapshots: a saved block's bytes leave device memory when `save()` is called.

Invariants:
- The device-to-host copy is queued on a snapshot stream that first waits for the
  saving thread's current stream (the producer), so a block produced on a side stream
  is read only after it was written; the host does not wait.
- The source block is marked as in use by the snapshot stream (`record_stream`), so the
  caller may drop it at once; its memory is reused only after the copy has read it.
  Device memory held by saves is therefore only that of copies still queued: a slow
  store never keeps the engine's tensors.
- Host buffers come from a pool bounded in bytes (`max_bytes`, pinned on CUDA), are
  taken all-or-nothing per save and kept until `close`: when the store is slow the pool
  runs out and saves are dropped (and counted) instead of growing memory.
- Each buffer is laid out as the encoded block, [codec header | payload], written once:
  the saver hands it to the sealer or the store without joining or re-encoding.
- Only the threads that call the agent run this module; the saver thread only reads
  finished buffers (see replica_agent/saver.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import numpy as np
import torch

from replica_agent.codec import HEADER_BYTES, check_block, encode_header, torch_dtype
from replica_agent.device_ops import DeviceOps, Event, Stream
from replica_agent.spec import ModelSpec

NotTaken: TypeAlias = Literal["buffer_full", "capturing"]


class HostPool:
    """Host buffers of one encoded block each, at most `max_bytes` in all."""

    def __init__(self, spec: ModelSpec, ops: DeviceOps, device: torch.device, max_bytes: int):
        self.block_bytes = HEADER_BYTES + spec.block_payload_bytes
        if max_bytes < self.block_bytes:
            raise ValueError(
                f"save_buffer_bytes {max_bytes} is smaller than one encoded block "
                f"({self.block_bytes} bytes); raise it to at least that"
            )
        self.capacity = max_bytes // self.block_bytes  # buffers
        self._spec, self._ops, self._device = spec, ops, device
        self._header = np.frombuffer(encode_header(spec), dtype=np.uint8)
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lock = threading.Lock()

    def take(self, count: int) -> list[torch.Tensor] | None:
        """`count` buffers, or None (and nothing taken) when the pool cannot give them."""
        with self._lock:
            if count > len(self._free) + self.capacity - self._made:
                return None
            while len(self._free) < count:
                self._free.append(self._new_buffer())
                self._made += 1
            taken, self._free = self._free[:count], self._free[count:]
            return taken

    def give_back(self, buffers: Sequence[torch.Tensor]) -> None:
        """Return buffers (any thread: only a list append, no device call)."""
        with self._lock:
            self._free.extend(buffers)

    @property
    def bytes_made(self) -> int:
        return self._made * self.block_bytes

    def _new_buffer(self) -> torch.Tensor:
        if self._device.type == "cuda":
            buffer = self._ops.empty_host(self.block_bytes, self._device)
        else:
            buffer = torch.empty(self.block_bytes, dtype=torch.uint8)
        buffer.numpy()[:HEADER_BYTES] = self._header
        return buffer

    def payload(self, buffer: torch.Tensor) -> torch.Tensor:
        """The block-shaped tensor view of `buffer`'s payload (after the header)."""
        return buffer[HEADER_BYTES:].view(torch_dtype(self._spec)).view(self._spec.block_shape)


@dataclass
class Snapshot:
    buffers: list[torch.Tensor]  # encoded blocks: [header | payload], uint8
    events: list[Event] = field(default_factory=list)  # device copies still to finish

    def encoded(self) -> list[memoryview]:
        """The encoded blocks (read them only once the copies are done)."""
        return [buffer.numpy().data for buffer in self.buffers]


class Snapshotter:
    """Copies blocks into pool buffers at save time, ordered after their producer."""

    def __init__(self, spec: ModelSpec, ops: DeviceOps, pool: HostPool) -> None:
        self.spec, self.ops, self.pool = spec, ops, pool
        self._streams: dict[torch.device, Stream] = {}
        self._lock = threading.Lock()

    def take(self, blocks: Sequence[torch.Tensor]) -> Snapshot | NotTaken:
        """A snapshot of `blocks` (device copies queued), or why none was taken."""
        for block in blocks:
            check_block(self.spec, block)
        devices = [self.ops.device_of(block) for block in blocks]
        on_device = sorted({d for d in devices if d.type == "cuda"}, key=str)
        if any(self.ops.is_capturing(device) for device in on_device):
            return "capturing"  # no copies into an engine's graph
        buffers = self.pool.take(len(blocks))
        if buffers is None:
            return "buffer_full"
        snapshot = Snapshot(buffers)
        try:
            for device in on_device:
                triples = zip(blocks, buffers, devices, strict=True)
                pairs = [(block, buffer) for block, buffer, d in triples if d == device]
                snapshot.events.append(self._copy_from(device, pairs))
            for block, buffer, device in zip(blocks, buffers, devices, strict=True):
                if device.type != "cuda":
                    self.pool.payload(buffer).copy_(block)
        except BaseException:
            self.wait(snapshot)  # queued copies may still write the buffers
            self.pool.give_back(buffers)
            raise
        return snapshot

    def _copy_from(
        self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Event:
        stream = self._stream(device)
        self.ops.wait(stream, self.ops.record(self.ops.current_stream(device)))
        for block, buffer in pairs:
            self.ops.copy(self.pool.payload(buffer), block, stream)
            self.ops.keep_alive(block, stream)
        return self.ops.record(stream)

    def is_done(self, snapshot: Snapshot) -> bool:
        return all(self.ops.query(event) for event in snapshot.events)

    def wait(self, snapshot: Snapshot) -> None:
        for event in snapshot.events:
            self.ops.synchronize(event)

    def _stream(self, device: torch.device) -> Stream:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = self.ops.new_stream(device)
            return stream
