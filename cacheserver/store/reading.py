"""One GET's read of the store: the leading present blocks, batch by batch.

A transport asks for batches until there is none; each batch holds blocks of one tier
(a run found in memory, or a read of about `max_bytes` through the lower tiers) and
says whether another can follow (`final`), so a transport can send what it has before
the next batch reads the disk, and send everything at once when nothing more comes.

Payloads may be views of put-journal records: they stay valid until the next
`next_batch`, `release` or the end of the `with` block, and not longer (their space is
reused only once no reader that may hold them is left). A transport that keeps bytes
past that copies them first; one that may wait on a slow peer releases early.

Counting is done here, once, for every transport: blocks and bytes served per tier as
batches are handed out, then hits and misses of the whole GET when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from cacheserver.events import StoreEvents, Tier
from cacheserver.tiers import Payload
from policy.types import StorageKey, TenantId


@dataclass(frozen=True, slots=True)
class Batch:
    payloads: Sequence[Payload]
    tier: Tier
    final: bool  # no batch follows: the keys ended, or the next one is a miss


class ReadSource(Protocol):
    """What a Reading needs of the store (cacheserver.store.BlockStore)."""

    events: StoreEvents

    def pin(self) -> Callable[[], None]:
        """Keep journal record views valid; returns the function that lets go."""
        ...

    def read_from_memory(
        self, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads held in memory (about `max_bytes` of them, at least one),
        and whether the key after them is stored."""
        ...

    def read_through(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads from the lower tiers (at least one when the first key is
        stored), promoted to memory, and whether the key after them is stored. Blocking."""
        ...


class Reading:
    def __init__(self, source: ReadSource, tenant: TenantId, keys: Sequence[StorageKey]) -> None:
        self._source = source
        self._tenant = tenant
        self._keys = keys
        self._unpin: Callable[[], None] | None = None
        self._asked = len(keys)
        self.served = 0  # blocks handed out (less any `unsent`)
        self._done = not keys
        self._last: Batch | None = None  # handed out, not yet counted
        self._unsent = 0  # of which the caller did not send

    def __enter__(self) -> Reading:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
        self._count_last()
        self._source.events.got(self._tenant, self._asked, self.served)

    def next_batch(self, max_bytes: int) -> Batch | None:
        """The next leading present blocks, about `max_bytes` of them (from memory, else
        read through the lower tiers), or None at the first miss or the end. Blocking
        when it reads the disk: call it off an event loop."""
        self.release()
        self._count_last()
        if self._done:
            return None
        self._unpin = self._source.pin()
        rest = self._keys[self.served :]
        tier: Tier = "memory"
        payloads, more = self._source.read_from_memory(rest, max_bytes)
        if not payloads:
            tier = "lmdb"
            payloads, more = self._source.read_through(self._tenant, rest, max_bytes)
        if not payloads:
            self._done = True
            self.release()
            return None
        self.served += len(payloads)
        self._done = not more or self.served == len(self._keys)
        self._last = Batch(payloads, tier, self._done)
        return self._last

    def unsent(self, blocks: int) -> None:
        """The last `blocks` payloads of the last batch were not sent (the reply filled
        up): they are not counted as served, nor the rest of the GET as missed — the
        caller asks for them again. The read ends here."""
        last = self._last
        if last is None or not 0 < blocks <= len(last.payloads):
            return
        self._unsent = blocks
        self.served -= blocks
        self._asked = self.served
        self._done = True

    def _count_last(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            sent = last.payloads[: len(last.payloads) - self._unsent]
            self._unsent = 0
            if sent:
                self._source.events.served(self._tenant, last.tier, len(sent), _nbytes(sent))

    def release(self) -> None:
        """The last batch's payloads are no longer used (sent, or copied)."""
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin()


def _nbytes(payloads: Sequence[Payload]) -> int:
    return sum(len(p) for p in payloads)
