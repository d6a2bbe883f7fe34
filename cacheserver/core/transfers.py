"""A GET's reply and a put's blocks as the request core hands them to a transport.

`GetReply` is the one loop over the store's batches: a transport iterates it and
encodes each `Served` batch. What a transport can carry is its acceptance predicate
(`Accept`): the sealed channel takes only sealed blocks, the same-host arena only what
still fits; the first block it does not take ends the reply, and the store counts those
blocks as not sent rather than missed (`Reading.unsent`).

`PutStream` takes a put's blocks as a transport learns of them: each is announced
(admitted, before any of its bytes are taken), then stored from its `BlockSource`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator, Sequence
from types import TracebackType

from cacheserver.blocks import BlockSource, CheckedSource, Payload
from cacheserver.core.admission import Admission
from cacheserver.core.values import Accept, Admitted, Announced, PutNamespace, Served
from cacheserver.store import BlockStore
from cacheserver.store.reading import Reading
from policy import AccessPolicy
from policy.types import TenantId


class GetReply:
    """The leading present blocks of an admitted GET, batch by batch: `with reply:`,
    then iterate. Iterating reads the store (blocking when it reads the disk)."""

    def __init__(
        self, store: BlockStore, request: Admitted, batch_bytes: int, accept: Accept | None
    ) -> None:
        self._store = store
        self._request = request
        self._batch_bytes = batch_bytes
        self._accept = accept
        self._reading: Reading | None = None
        self._done = False

    @property
    def tenant(self) -> TenantId:
        return self._request.tenant

    def __enter__(self) -> GetReply:
        self._reading = self._store.read(self._request.tenant, self._request.keys)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._reading is not None:
            self._reading.__exit__(exc_type, exc, tb)  # counts the GET's hits and misses

    def __iter__(self) -> Iterator[Served]:
        return self

    def __next__(self) -> Served:
        reading = self._reading
        assert reading is not None, "use the reply in a `with` block"
        if self._done:  # never ask past a final batch: that would let its views go
            raise StopIteration
        batch = reading.next_batch(self._batch_bytes)
        if batch is None:
            self._done = True
            raise StopIteration
        payloads = batch.payloads
        taken = _leading(payloads, self._accept)
        if taken < len(payloads):
            reading.unsent(len(payloads) - taken)
        self._done = batch.final or taken < len(payloads)
        return Served(reading.served - taken, payloads[:taken], self._done)

    def next_served(self) -> Served | None:
        """The next batch, or None at the end (for a transport that reads it on a
        worker thread)."""
        return next(self, None)

    def release(self) -> None:
        """The last batch's payloads are no longer used (sent, or copied): a transport
        that waits on a slow peer lets go of journal records early."""
        if self._reading is not None:
            self._reading.release()


def _leading(payloads: Sequence[Payload], accept: Accept | None) -> int:
    """How many of `payloads`, from the first, the transport takes."""
    if accept is None:
        return len(payloads)
    for index, payload in enumerate(payloads):
        if not accept(payload):
            return index
    return len(payloads)


class PutStream:
    """One put's blocks: `announce` each (admission), then `store` it. `with` it: a
    block announced and never stored gives its receive budget back at the end."""

    def __init__(
        self, store: BlockStore, policy: AccessPolicy, admission: Admission, put: PutNamespace
    ) -> None:
        self._store = store
        self._policy = policy
        self._admission = admission
        self._put = put
        self._announced = 0
        self._pending: dict[int, Announced] = {}  # announced, not yet handed to the store

    @property
    def tenant(self) -> TenantId:
        return self._put.tenant

    def __enter__(self) -> PutStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """The put ended (well or not): blocks announced and never stored give their
        receive budget back."""
        # Swapped, not cleared: a `store` still running on a worker thread (its caller
        # gone) then finds its block taken, and the budget is given back once.
        pending, self._pending = self._pending, {}
        for block in pending.values():
            self._admission.handed_over(self._put, block)

    def announce(self, digest: bytes, size: int, *, hold: bool = False) -> Announced:
        """The next block, admitted before any of its bytes are taken. `hold`: the
        transport keeps its bytes in memory until it is stored (receive budget)."""
        block = self._admission.announce(self._put, self._announced, digest, size, hold=hold)
        self._announced += 1
        self._pending[block.index] = block
        return block

    def store(self, block: Announced, source: BlockSource) -> concurrent.futures.Future[bool]:
        """Store `block` from `source`. Refusals raise; the future says stored (True) or
        already present (False) once the block is acknowledged (BlockStore.put)."""
        tenant, index = self._put.tenant, block.index

        def check(payload: Payload) -> None:
            self._policy.check_payload(tenant, payload, index)

        try:
            return self._store.put(tenant, block.key, self._put.tag, CheckedSource(source, check))
        finally:
            if self._pending.pop(index, None) is not None:
                self._admission.handed_over(self._put, block)
