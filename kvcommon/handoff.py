"""Work that may block, told ahead to the thread running it.

A thread that serves many connections in turn (the bulk listener's ready loop,
cacheserver.transport.bulk.readyloop) must not wait on one of them: while it serves a
request it arms a hook here, and any code about to wait (a reply the socket buffer does
not take at once, a put waiting for journal or backlog room) calls `before_blocking()`
first. The hook hands the thread's other duties to another thread, once, and the wait
then holds up only this request. Threads that never arm a hook pay one attribute read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class _Hook(threading.local):
    """The running thread's hook. A class attribute is every thread's default: reading
    an attribute a thread never set through `getattr(local, name, None)` raises and
    catches an AttributeError inside (~0.7 us, three times a client GET); this read is
    a plain lookup (~0.06 us)."""

    hook: Callable[[], None] | None = None


_local = _Hook()


def armed() -> bool:
    """Whether the running thread must hand off before it waits."""
    return _local.hook is not None


def before_blocking() -> None:
    """Call before a wait that may last: runs the thread's hook, once."""
    hook = _local.hook
    if hook is not None:
        _local.hook = None
        hook()


def hands_off(hook: Callable[[], None]) -> HandsOff:
    """Within this block, the first `before_blocking()` on this thread calls `hook`."""
    return HandsOff(hook)


class HandsOff:
    """`hands_off`'s block: a class, not a generator, as the ready loop enters one for
    every request it serves (a generator-based context manager costs ~1 µs more). It
    holds only the hook, so one thread may enter the same block for every request."""

    __slots__ = ("_hook",)

    def __init__(self, hook: Callable[[], None]) -> None:
        self._hook = hook

    def __enter__(self) -> None:
        _local.hook = self._hook

    def __exit__(self, *exc_info: object) -> None:
        _local.hook = None
