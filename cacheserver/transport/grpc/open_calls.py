"""The gRPC calls in flight, by principal: what a live reload ends when it revokes one.

A call is admitted once, when it starts; a Put stream may then run for as long as its
client sends. When a reload removes a principal, replaces its credential or takes
tenants or actions from it, the server ends its calls in flight here
(`end`): each one's handler task is cancelled, and the wrapper that runs it
(cacheserver.transport.grpc.wire) answers the cancellation with the status `ended_with`
gives (UNAUTHENTICATED for a revoked credential, PERMISSION_DENIED for reduced grants)
instead of letting it pass as a client's cancellation. Everything here runs on the
server's event loop: no lock.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from kvcommon.errors import KvshareError, PermissionDenied, Unauthenticated
from policy.access import REVOKED_MESSAGE

# The reasons (policy.access_change) that end a principal's calls in flight: a changed
# rate alone leaves them running (their next call draws at the new rate).
ENDING_REASONS = frozenset({"removed", "credential replaced", "grants reduced"})


class OpenCalls:
    def __init__(self) -> None:
        self._tasks: dict[str, set[asyncio.Task[object]]] = {}
        # A cancellation that lands in grpc's own code (a Get stream's write) never
        # reaches the wrapper: weak keys, so its entry goes with its task.
        self._ended: weakref.WeakKeyDictionary[asyncio.Task[object], str] = (
            weakref.WeakKeyDictionary()
        )

    @contextmanager
    def open(self, principal: str) -> Iterator[None]:
        """The current task serves a call of `principal` for the `with` block."""
        task = asyncio.current_task()
        if task is None:  # not on a loop's task: nothing to end
            yield
            return
        tasks = self._tasks.setdefault(principal, set())
        tasks.add(task)
        try:
            yield
        finally:
            tasks.discard(task)
            if not tasks:
                self._tasks.pop(principal, None)

    def end(self, principals: Mapping[str, str]) -> int:
        """End the calls in flight of the named principals (name -> reason, as
        policy.access_change gives it); returns how many were ended."""
        ended = 0
        this = asyncio.current_task()  # the admin's own Reload call answers it
        for name, reason in principals.items():
            if reason not in ENDING_REASONS:
                continue
            for task in self._tasks.get(name, ()):
                if task is this:
                    continue
                self._ended[task] = reason
                task.cancel()
                ended += 1
        return ended

    def ended_with(self) -> KvshareError | None:
        """What the current task's call answers after a cancellation: the error for
        an `end`, or None (the client cancelled, or the server stops)."""
        task = asyncio.current_task()
        reason = self._ended.pop(task, None) if task is not None else None
        if reason is None:
            return None
        if reason == "grants reduced":
            return PermissionDenied(
                "this principal's tenants or actions were reduced by a config reload; "
                "call again (what it may still do is allowed)"
            )
        return Unauthenticated(REVOKED_MESSAGE)

    def __len__(self) -> int:
        return sum(len(tasks) for tasks in self._tasks.values())
