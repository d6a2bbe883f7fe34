"""Where a put's bytes come from: the one shape every transport hands the store.

The store decides where a block's bytes go — straight into a put-journal record, or a
buffer of their own that the memory tier keeps — and whether they are wanted at all (a
block already stored is passed over). A transport describes its bytes with a
`BlockSource` and never learns which: a socket fills the target with `recv_into`, the
same-host arena copies into it, gRPC already holds the bytes (`BytesSource`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias

# A block's bytes as the store holds them: bytes from gRPC, the receive buffer itself
# (bytearray, never written again), or a view of its record in the put journal, where
# the bulk channel received it; no path copies.
Payload: TypeAlias = bytes | bytearray | memoryview


class BlockSource(Protocol):
    """One block's bytes. The store calls exactly one of `payload`+`fill` or `skip`."""

    @property
    def size(self) -> int: ...

    def payload(self) -> Payload | None:
        """The whole block, when the caller already holds it (then no copy is needed
        where the store keeps a buffer of its own); None: use `fill`."""
        ...

    def fill(self, target: memoryview) -> None:
        """Write the block's `size` bytes into `target`. Raising gives the put up."""
        ...

    def skip(self) -> None:
        """The block is not wanted (already stored): pass over its bytes."""
        ...


class BytesSource:
    """A block whose bytes are already in memory (gRPC)."""

    def __init__(self, data: Payload) -> None:
        self._data = data

    @property
    def size(self) -> int:
        return len(self._data)

    def payload(self) -> Payload:
        return self._data

    def fill(self, target: memoryview) -> None:
        target[:] = memoryview(self._data).cast("B")

    def skip(self) -> None:
        pass


class CheckedSource:
    """A source whose bytes are checked (`check(payload)`, raising to refuse) as soon
    as they are complete, before the store makes the block visible."""

    def __init__(self, inner: BlockSource, check: Callable[[Payload], None]) -> None:
        self._inner = inner
        self._check = check

    @property
    def size(self) -> int:
        return self._inner.size

    def payload(self) -> Payload | None:
        data = self._inner.payload()
        if data is not None:
            self._check(data)
        return data

    def fill(self, target: memoryview) -> None:
        self._inner.fill(target)
        self._check(target)

    def skip(self) -> None:
        self._inner.skip()
