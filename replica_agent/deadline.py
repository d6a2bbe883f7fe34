"""One client call's deadline: `timeout_s` bounds the whole call, not each receive.

A socket timeout (the kernel's SO_RCVTIMEO, or Python's own) bounds one system call: a
reply dripped a byte at a time restarts it with every byte, so a hostile store or an
on-path relay could hold a call (and the engine behind it) for as long as it liked. A
`CallDeadline` is the absolute time by which a `BlockClient` call must be done: opening
the bulk ticket, connecting, the TLS or sealed-channel handshake, the request, every
byte of the reply, and a fallback to gRPC all take what is left of it. When it runs
out the call fails with DEADLINE_EXCEEDED, a breaker failure in the store gate.

The hot path stays as it was: a connection keeps its socket timeout between calls, and
`SocketTimer.arm` sets it again only when it would let a system call end more than
`slack_s` after the deadline, or before it. A call that is done within `slack_s` makes
no extra system call; a slow one re-arms its socket at most once per `slack_s`.
"""

from __future__ import annotations

import socket
import time
from typing import Final

from kvcommon import bulkio
from replica_agent.errors import BlockStoreError, store_error

# How far past its deadline a single receive may end. Re-arming on every receive would
# bound it exactly, at two setsockopt calls per receive (two per block and more): a
# budget's tenth, at most 50 ms, is well inside what a caller notices.
MAX_SLACK_S: Final = 0.05


class CallDeadline:
    """The time left to one call; `budget_s` None: no deadline (the client's
    `timeout_s=None`)."""

    __slots__ = ("at", "budget_s", "slack_s")  # one is made for every call

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self.at: float | None
        if budget_s is None:
            self.at = None
            self.slack_s = 0.0
        else:  # made for every call: a conditional, not min() (a call of its own)
            self.at = time.monotonic() + budget_s
            slack_s = budget_s / 10
            self.slack_s = slack_s if slack_s < MAX_SLACK_S else MAX_SLACK_S

    def left_s(self) -> float | None:
        """Seconds left (None: unbounded); TimeoutError, as a socket would raise, once
        there are none."""
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call ran out of its deadline")
        return left

    def is_spent(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def exceeded(self) -> BlockStoreError:
        """The error a call that ran out of its deadline ends with."""
        return store_error(
            "DEADLINE_EXCEEDED",
            f"the store did not answer within timeout_s {self.budget_s} s; "
            "a miss or a dropped save (raise timeout_s if the store is just slow)",
        )

    def grpc_timeout_s(self) -> float | None:
        """The timeout of a gRPC call made now; DEADLINE_EXCEEDED once nothing is left."""
        try:
            return self.left_s()
        except TimeoutError:
            raise self.exceeded() from None


NO_DEADLINE: Final = CallDeadline(None)


class SocketTimer:
    """A connection's socket timeout, kept within the current call's deadline: what
    `kvcommon.bulkio` calls around each system call (`recv_exact`, `send_parts`).

    Invariant: whenever a system call starts, the socket's timeout is at least what is
    left of the deadline (no call fails early) and at most that plus `slack_s` (none
    ends long after it), so a receive or send that times out means the call is out of
    time. The timeout stays set between calls (`disarm` does nothing)."""

    __slots__ = ("deadline", "timeout_s")

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s  # what the socket has now
        self.deadline = NO_DEADLINE  # the current call's; set by the call

    def arm(self, sock: socket.socket) -> None:
        # CallDeadline.left_s written out: this runs before every send and receive.
        deadline = self.deadline
        at = deadline.at
        if at is None:
            return
        left = at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call ran out of its deadline")
        current = self.timeout_s
        if current is not None and left <= current <= left + deadline.slack_s:
            return
        bulkio.set_timeout(sock, left)
        self.timeout_s = left

    def disarm(self, sock: socket.socket) -> None:
        return None
