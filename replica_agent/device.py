"""Moving opened blocks into device memory, in order, without mixing callers' bytes.

On a CUDA device each block is decoded into a pinned staging buffer and copied with a
non-blocking copy on a dedicated copy stream, so block i+1 is fetched and decoded while
block i is still being copied. Invariants:

- A staging ring (two pinned buffers, a copy stream, an event per buffer) belongs to
  one restore at a time: concurrent restores on one agent take different rings from a
  bounded pool, so one caller's decode never overwrites a buffer another caller's
  queued copy has yet to read (the bug that put one tenant's blocks in another's
  restore). A buffer is rewritten only after the event of the copy that last read it.
- The copy stream starts after the caller's stream has reached the point where the
  destination was allocated, and the caller's stream waits for the copies by an event:
  no host synchronisation, and a miss costs no device work at all.
- Every reuse of a staging buffer overwrites all of it, so nothing of one tenant's block
  is left for another (the LeftoverLocals lesson). A sealed block is opened straight
  into its slot (`SealedView.open_into`: a slot is the 64-byte codec header and the
  block, its tensor a view from byte 64), checked there, and copied to the device from
  it: one host copy per byte after the socket.
- Device memory is allocated when the first block has arrived and decoded; running out
  of it ends the restore as a miss (`Restored.stopped_by`), never as an exception; a
  partial restore returns a tensor of the blocks it holds and releases the rest.

On the CPU a block is decoded straight into its destination, and a sealed block is
opened straight into it when the destination is one contiguous block with 64 bytes
before it that this restore owns (the room `restore` allocates in front of its first
block, or the end of the block this restore wrote just before, saved and put back):
the AEAD writes the codec header there, `decode_block` checks header and values in
place. Other placements (an engine's per-layer parts, its first block) open into a kept
host scratch and are copied from it. A block that fails to open, is not of the spec or
is not finite leaves zeros where it was opened, never plaintext the engine could use,
and ends the restore. `restore_into` is the primitive for engine adapters: the caller
names, per block, where its parts go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeAlias

import torch

from replica_agent.codec import HEADER_BYTES, BlockFormatError, decode_block, torch_dtype
from replica_agent.device_ops import CudaOps, DeviceOps, Event, Stream, resolve_device
from replica_agent.gate import SealedView
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import StopReason

STAGING_BUFFERS = 2  # double buffering: decode one while the other is in flight
STAGING_RINGS = 4  # restores at once per agent; more wait for a ring (pinned memory bound)
# Where one part of a block goes: (destination tensor, index into the block tensor),
# e.g. `(out[i], ())` for a whole block or `(keys[l][0, :, a:b], (l, 0))` for layer l's K.
Placement: TypeAlias = tuple[torch.Tensor, tuple[int, ...]]
Targets: TypeAlias = Callable[[int], Sequence[Placement]]
# What a restore reads: plaintext block bytes, or sealed ones it opens into its buffers.
Payload: TypeAlias = bytes | memoryview | SealedView


@dataclass(frozen=True)
class Restored:
    blocks: int  # leading blocks now in place (ordered before the caller's later work)
    stopped_by: StopReason | None = None  # why fewer than offered, when not a short source


@dataclass
class _Slot:
    raw: torch.Tensor  # uint8, the codec header then the block (pinned on CUDA)
    buffer: torch.Tensor  # `spec.block_shape`, a view of `raw` from byte HEADER_BYTES
    read_by: Event | None = None  # the copy that last read this buffer

    @classmethod
    def over(cls, raw: torch.Tensor, spec: ModelSpec) -> _Slot:
        block = raw[HEADER_BYTES:].view(torch_dtype(spec)).view(spec.block_shape)
        return cls(raw, block)


class _Ring:
    """Staging owned by one restore at a time: buffers, their events, a copy stream."""

    def __init__(self, ops: DeviceOps, device: torch.device, spec: ModelSpec) -> None:
        self.stream = ops.new_stream(device)
        size = HEADER_BYTES + spec.block_payload_bytes
        self.slots = [
            _Slot.over(ops.empty_host(size, device), spec) for _ in range(STAGING_BUFFERS)
        ]
        self._next = 0

    def next_slot(self) -> _Slot:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot


class StagingPool:
    """At most `max_rings` rings, made on first need and kept; a restore borrows one."""

    def __init__(
        self, ops: DeviceOps, device: torch.device, spec: ModelSpec, max_rings: int
    ) -> None:
        if max_rings < 1:
            raise ValueError(f"max_rings is {max_rings}; allow at least one restore at a time")
        self._ops, self._device, self._spec = ops, device, spec
        self.max_rings = max_rings
        self._free: list[_Ring] = []
        self._made = 0
        self._changed = threading.Condition()

    @contextmanager
    def ring(self) -> Iterator[_Ring]:
        with self._changed:
            while not self._free and self._made >= self.max_rings:
                self._changed.wait()
            ring = self._free.pop() if self._free else None
            if ring is None:
                self._made += 1
        if ring is None:
            try:
                ring = _Ring(self._ops, self._device, self._spec)
            except BaseException:
                with self._changed:
                    self._made -= 1
                    self._changed.notify()
                raise
        try:
            yield ring
        finally:
            with self._changed:
                self._free.append(ring)
                self._changed.notify()

    @property
    def rings_made(self) -> int:
        return self._made


class _HostScratch:
    """CPU restores' buffers for blocks not opened in place (module docstring): the
    codec header and one block each, at most `keep` kept for later restores."""

    def __init__(self, spec: ModelSpec, keep: int) -> None:
        self._spec, self._keep = spec, keep
        self._free: list[_Slot] = []
        self._lock = threading.Lock()

    def take(self) -> _Slot:
        with self._lock:
            if self._free:
                return self._free.pop()
        size = HEADER_BYTES + self._spec.block_payload_bytes
        return _Slot.over(torch.empty(size, dtype=torch.uint8), self._spec)

    def give_back(self, slot: _Slot) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(slot)


class BlockRestorer:
    """Restores blocks of `spec` into memory of `device` (explicit index on CUDA)."""

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device | str = "cpu",
        *,
        ops: DeviceOps | None = None,
        max_concurrent: int = STAGING_RINGS,
    ) -> None:
        self.spec = spec
        self.ops: DeviceOps = ops or CudaOps()
        self.device = resolve_device(device, self.ops)
        self.staging = (
            StagingPool(self.ops, self.device, spec, max_concurrent)
            if self.device.type == "cuda"
            else None
        )
        self._scratch = _HostScratch(spec, max_concurrent)

    def restore(
        self,
        payloads: Iterable[Payload],
        max_blocks: int,
        *,
        stream: Stream | None = None,
    ) -> tuple[torch.Tensor, Restored]:
        """Blocks `[n, *block_shape]` on the device, n <= max_blocks, in order.

        `payloads` yields plaintext block bytes or sealed blocks (`SealedView`) and may
        stop early (a miss). A block that fails to open or decode ends the restore (the
        bad bytes never become a tensor the model sees). On CUDA the result is ready for
        work queued on `stream` (default: the caller's current stream) after this
        returns. On the CPU the blocks' memory starts HEADER_BYTES into its allocation:
        the first block is opened in place too.
        """
        stream = self._consumer(stream)
        held: list[torch.Tensor] = []
        room: list[torch.Tensor] = []

        def whole_blocks(index: int) -> Sequence[Placement]:
            if not held and stream is None:
                flat = torch.empty(
                    HEADER_BYTES + max_blocks * self.spec.block_payload_bytes, dtype=torch.uint8
                )
                dtype = torch_dtype(self.spec)
                held.append(
                    flat[HEADER_BYTES:].view(dtype).view(max_blocks, *self.spec.block_shape)
                )
                room.append(flat[:HEADER_BYTES])
            elif not held:
                held.append(self._empty((max_blocks, *self.spec.block_shape), stream))
            return [(held[0][index], ())]

        if self.staging is None:
            restored = self._restore_on_host(
                payloads, whole_blocks, max_blocks, lambda: room[0] if room else None
            )
        else:
            restored = self.restore_into(payloads, whole_blocks, max_blocks, stream=stream)
        if not held:
            return self._empty((0, *self.spec.block_shape), stream), restored
        return self.leading(held[0], restored.blocks, stream=stream), restored

    def restore_into(
        self,
        payloads: Iterable[Payload],
        targets: Targets,
        max_blocks: int,
        *,
        stream: Stream | None = None,
    ) -> Restored:
        """Each decoded block i goes to `targets(i)`'s destinations (engine adapters).

        Destinations live on this restorer's device; `targets` allocates them at its
        first call at the latest (allocation raising `torch.OutOfMemoryError` ends the
        restore as a miss). On CUDA the copies run on a copy stream and `stream`
        (default: the current stream) waits for them; the host does not.
        """
        if self.staging is None:
            return self._restore_on_host(payloads, targets, max_blocks)
        if max_blocks <= 0:
            return Restored(0)
        consumer = self._consumer(stream)
        assert consumer is not None
        if self.ops.is_capturing(self.device):
            return Restored(0, "capturing")  # never queue copies into an engine's graph
        with self.staging.ring() as ring:
            return self._restore_via_ring(ring, payloads, targets, max_blocks, consumer)

    def _restore_via_ring(
        self,
        ring: _Ring,
        payloads: Iterable[Payload],
        targets: Targets,
        max_blocks: int,
        consumer: Stream,
    ) -> Restored:
        ops, count = self.ops, 0
        stopped: StopReason | None = None
        try:
            for payload in payloads:
                if count == max_blocks:
                    break
                slot = ring.next_slot()
                if slot.read_by is not None:
                    ops.synchronize(slot.read_by)  # the copy that last read it has run
                try:
                    if not self._fill(payload, slot):
                        break  # did not open: counted by the gate, the slot zeroed
                    parts = self._placements(targets, count)
                except BlockFormatError:
                    stopped = "format_error"
                    break
                except torch.OutOfMemoryError:
                    stopped = "out_of_memory"
                    break
                if count == 0:  # after the destinations exist: their memory is free
                    ops.wait(ring.stream, ops.record(consumer))
                for destination, index in parts:
                    ops.copy(destination, slot.buffer[index], ring.stream)
                slot.read_by = ops.record(ring.stream)
                count += 1
        finally:
            if count:
                ops.wait(consumer, ops.record(ring.stream))
        return Restored(count, stopped)

    def _restore_on_host(
        self,
        payloads: Iterable[Payload],
        targets: Targets,
        max_blocks: int,
        first_room: Callable[[], torch.Tensor | None] = lambda: None,
    ) -> Restored:
        count, scratch = 0, None
        before: torch.Tensor | None = None  # the bytes this restore wrote last
        try:
            for payload in payloads:
                if count == max_blocks:
                    break
                try:
                    parts = self._placements(targets, count)
                    whole = _whole_block(parts)
                    if count == 0:
                        before = first_room()
                    region = _with_room(whole, before)
                    if whole is not None and not isinstance(payload, SealedView):
                        decode_block(self.spec, payload, out=whole)  # straight in
                    elif whole is not None and region is not None:
                        if not self._open_in_place(payload, region, whole):
                            return Restored(count)
                    else:
                        scratch = scratch or self._scratch.take()
                        if not self._fill(payload, scratch):
                            return Restored(count)
                        for destination, index in parts:
                            destination.copy_(scratch.buffer[index])
                    before = whole
                except BlockFormatError:
                    return Restored(count, "format_error")
                except torch.OutOfMemoryError:
                    return Restored(count, "out_of_memory")
                count += 1
            return Restored(count)
        finally:
            if scratch is not None:
                self._scratch.give_back(scratch)

    def _fill(self, payload: Payload, slot: _Slot) -> bool:
        """The checked block of `payload` in `slot.buffer`: True; False when a sealed
        payload did not open (counted by the gate; the slot zeroed). BlockFormatError
        when it is not a block of the spec, with nothing of it left in the slot."""
        if not isinstance(payload, SealedView):
            decode_block(self.spec, payload, out=slot.buffer)  # checked, then copied
            return True
        if payload.opened_bytes != slot.raw.numel():  # no block of the spec: refused
            plaintext = payload.open()  # as before, once authenticated (or tampered)
            if plaintext is None:
                return False
            decode_block(self.spec, plaintext, out=slot.buffer)
            return True
        opened = payload.open_into(slot.raw.numpy().data)  # the one host copy
        if opened is None:
            return False
        try:
            decode_block(self.spec, opened, out=slot.buffer)  # in place: checks only
        except BlockFormatError:
            slot.raw.zero_()
            raise
        return True

    def _open_in_place(self, payload: Payload, region: torch.Tensor, whole: torch.Tensor) -> bool:
        """`_fill` into the destination `whole` itself, the codec header opened into the
        HEADER_BYTES before it (`region` spans both), whose bytes are put back after."""
        kept = region[:HEADER_BYTES].clone()
        try:
            return self._fill(payload, _Slot(region, whole))
        finally:
            region[:HEADER_BYTES].copy_(kept)

    def _placements(self, targets: Targets, index: int) -> Sequence[Placement]:
        parts = targets(index)
        for destination, _ in parts:
            if self.ops.device_of(destination) != self.device:
                raise ValueError(
                    f"a destination is on {self.ops.device_of(destination)}; this restorer "
                    f"copies to {self.device}: use a restorer per device"
                )
        return parts

    def _consumer(self, stream: Stream | None) -> Stream | None:
        if stream is not None or self.staging is None:
            return stream  # None on the CPU: no streams there
        return self.ops.current_stream(self.device)

    def _empty(self, shape: tuple[int, ...], stream: Stream | None) -> torch.Tensor:
        dtype = torch_dtype(self.spec)
        if stream is None:
            return torch.empty(shape, dtype=dtype)
        return self.ops.empty(shape, dtype, self.device, stream)

    def is_capturing(self) -> bool:
        """Whether the calling thread is capturing a CUDA graph on this device."""
        return self.staging is not None and self.ops.is_capturing(self.device)

    def leading(
        self, blocks: torch.Tensor, count: int, *, stream: Stream | None = None
    ) -> torch.Tensor:
        """The first `count` of `blocks` in memory of their own: a partial restore must
        not keep the whole allocation alive through a view. On CUDA the copy is queued
        on `stream` (default: the current stream), which is where `blocks` is ready."""
        if count >= blocks.shape[0]:
            return blocks
        stream = self._consumer(stream)
        try:
            kept = self._empty((count, *self.spec.block_shape), stream)
        except torch.OutOfMemoryError:
            return blocks[:count]  # correct, only larger than it needs to be
        if count and stream is None:
            kept.copy_(blocks[:count])
        elif count and stream is not None:
            self.ops.copy(kept, blocks[:count], stream)
        return kept


def _whole_block(parts: Sequence[Placement]) -> torch.Tensor | None:
    """The destination when `parts` is one whole contiguous block, else None."""
    if len(parts) == 1 and parts[0][1] == () and parts[0][0].is_contiguous():
        return parts[0][0]
    return None


def _with_room(whole: torch.Tensor | None, before: torch.Tensor | None) -> torch.Tensor | None:
    """The bytes of `whole` and the HEADER_BYTES before it, as one uint8 tensor, when
    those lie at the end of `before` (contiguous, in the same allocation): memory this
    restore owns. None otherwise (the bytes before `whole` may be the engine's)."""
    if whole is None or before is None or before.nbytes < HEADER_BYTES:
        return None
    storage = whole.untyped_storage()
    if before.untyped_storage().data_ptr() != storage.data_ptr():
        return None
    if not before.is_contiguous() or before.data_ptr() + before.nbytes != whole.data_ptr():
        return None
    start = whole.data_ptr() - storage.data_ptr()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return flat[start - HEADER_BYTES : start + whole.nbytes]
