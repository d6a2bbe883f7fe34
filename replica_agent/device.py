"""Moving decoded blocks into device memory: reused staging, non-blocking copies.

On a CUDA device each block is decoded into one of a small ring of pinned host
buffers and copied with `non_blocking=True`; an event per buffer says when the copy
has finished reading it, so block i+1 is decoded (and fetched, by the caller's
streaming iterator) while block i is still being copied. Buffers are reused across
calls and tenants; every reuse overwrites the whole buffer (decode writes all of it),
so nothing of one tenant's block is left for another (the LeftoverLocals lesson).
On the CPU the block is decoded straight into its slot of the output.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from replica_agent.codec import BlockFormatError, decode_block, torch_dtype
from replica_agent.spec import ModelSpec

STAGING_BUFFERS = 2  # double buffering: decode one while the other is in flight


class BlockRestorer:
    def __init__(self, spec: ModelSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        self._staging: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self.format_errors = 0
        if self.device.type == "cuda":
            for _ in range(STAGING_BUFFERS):
                self._staging.append(
                    torch.empty(spec.block_shape, dtype=torch_dtype(spec), pin_memory=True)
                )
                self._events.append(None)

    def restore(self, payloads: Iterator[bytes | memoryview], max_blocks: int) -> torch.Tensor:
        """Blocks `[n, *block_shape]` on the device, n <= max_blocks, in order.

        `payloads` yields plaintext block bytes and may stop early (a miss, or a block
        that failed to open). A block that fails to decode ends the restore too
        (counted in `format_errors`): the result holds only the blocks before it, and
        the bad bytes never become a tensor the model sees.
        """
        out = torch.empty(
            (max_blocks, *self.spec.block_shape), dtype=torch_dtype(self.spec), device=self.device
        )
        count = 0
        for payload in payloads:
            if count == max_blocks:
                break
            try:
                if self.device.type == "cuda":
                    self._copy_via_staging(payload, out[count], count)
                else:
                    decode_block(self.spec, payload, out=out[count])
            except BlockFormatError:
                self.format_errors += 1
                break
            count += 1
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out[:count]

    def _copy_via_staging(
        self, payload: bytes | memoryview, target: torch.Tensor, count: int
    ) -> None:
        slot = count % len(self._staging)
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer is done
        decode_block(self.spec, payload, out=self._staging[slot])
        target.copy_(self._staging[slot], non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(self.device))
        self._events[slot] = done
