"""Who may hold a bulk-channel connection, and for how long before it authenticates.

Two kinds of connection, counted apart so one cannot crowd out the other:

- Handshaking: accepted, no valid ticket yet. Anyone who can reach a listener makes
  these (a local user reaches the same-host listener: its name is in /proc/net/unix),
  so each listener has its own small pool, every such connection has a *total*
  deadline to finish TLS and present its ticket (a reaper shuts it down at the
  deadline, however slowly its bytes trickle in), and a full pool makes room by
  closing its oldest member, which has had the most time: a flood must outpace a
  real client's few-millisecond handshake to keep it out.
- Authenticated: bound to a principal by a ticket. Capped in total and per principal,
  so one principal's connections cannot take every slot.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from cacheserver.transport.caps import PrincipalCap

MAX_HANDSHAKING_PER_LISTENER = 64
MAX_AUTHENTICATED = 256
MAX_PER_PRINCIPAL = 64  # a replica uses one connection per thread and tenant
REAPER_TICK_S = 0.25


class ConnectionSlots:
    def __init__(
        self,
        handshake_timeout_s: float,
        *,
        max_handshaking: int = MAX_HANDSHAKING_PER_LISTENER,
        max_authenticated: int = MAX_AUTHENTICATED,
        max_per_principal: int = MAX_PER_PRINCIPAL,
        shut: Callable[[socket.socket], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.handshake_timeout_s = handshake_timeout_s
        self._max_handshaking = max_handshaking
        self._shut = shut or _shutdown
        self._clock = clock
        self._lock = threading.Condition()
        # listener name -> connections still handshaking, oldest first, with deadlines
        self._handshaking: dict[str, OrderedDict[socket.socket, float]] = {}
        self._principals: dict[socket.socket, str] = {}
        self._authenticated = PrincipalCap(
            max_authenticated,
            max_per_principal,
            lambda cap: (
                f"the bulk listener holds {cap} connections; retry later (the client "
                "uses gRPC meanwhile)"
            ),
            lambda principal, cap: (
                f"principal {principal!r} holds {cap} bulk connections "
                "already; close some, or share them between threads"
            ),
        )
        self._closed = False

    def accept(self, conn: socket.socket, listener: str) -> None:
        """A new, unauthenticated connection on `listener`; may close the oldest one."""
        with self._lock:
            pool = self._handshaking.setdefault(listener, OrderedDict())
            if len(pool) >= self._max_handshaking:
                oldest, _ = pool.popitem(last=False)
                self._shut(oldest)
            pool[conn] = self._clock() + self.handshake_timeout_s
            self._lock.notify()

    def authenticated(self, conn: socket.socket, principal: str) -> None:
        """The connection presented a valid ticket of `principal`: it leaves the
        handshaking pool and takes an authenticated slot, or ResourceExhausted."""
        with self._lock:
            for pool in self._handshaking.values():
                pool.pop(conn, None)
            self._authenticated.take(principal)
            self._principals[conn] = principal

    def rebind(self, old: socket.socket, new: socket.socket) -> None:
        """`old` became `new` (a TLS wrap detaches the accepted socket): the slot, its
        deadline and its place in the pool follow, so the reaper shuts `new`."""
        with self._lock:
            for pool in self._handshaking.values():
                if old in pool:
                    items = [(new if c is old else c, d) for c, d in pool.items()]
                    pool.clear()
                    pool.update(items)
            principal = self._principals.pop(old, None)
            if principal is not None:
                self._principals[new] = principal

    def release(self, conn: socket.socket) -> None:
        with self._lock:
            for pool in self._handshaking.values():
                pool.pop(conn, None)
            principal = self._principals.pop(conn, None)
            if principal is not None:
                self._authenticated.give_back(principal)

    def shut_principals(self, principals: Collection[str]) -> int:
        """Shut down every authenticated connection of the named principals (revoked or
        reduced by a live reload); returns how many. Shutting the server's descriptor
        shuts the connection itself: a bulk worker serving it (on a descriptor of its
        own) sees it end too, and each connection's thread or loop closes it as when
        its peer goes."""
        with self._lock:
            doomed = [conn for conn, name in self._principals.items() if name in principals]
        for conn in doomed:
            self._shut(conn)
        return len(doomed)

    def held_by(self, principal: str) -> int:
        """The authenticated connections `principal` holds open now."""
        with self._lock:
            return sum(1 for name in self._principals.values() if name == principal)

    def reap(self) -> None:
        """Shut down handshaking connections past their deadline, until `close`."""
        with self._lock:
            while not self._closed:
                now = self._clock()
                for pool in self._handshaking.values():
                    while pool and next(iter(pool.values())) <= now:
                        self._shut(pool.popitem(last=False)[0])
                self._lock.wait(REAPER_TICK_S)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()


def _shutdown(conn: socket.socket) -> None:
    """Wake the connection's thread (blocked in recv or a TLS handshake): it fails and
    closes the socket itself."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
