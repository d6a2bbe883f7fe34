"""The ready loop: plain-TCP bulk requests served by the thread that saw them arrive.

With a thread per connection, every request of every connection crosses threads: each
of its system calls lets go of the GIL, and with several connections busy each of
those becomes a hand-off between threads (a futex wake and wait, two context switches).
Measured on 2 cores with 4 clients, that doubled the server's CPU per 64 KiB put.

Here one thread, the leader, waits on every parked connection at once (epoll, one
shot per connection) and serves a request itself when the whole of it is already in
the socket (its header, body and, for a put, every payload byte: a peek and FIONREAD
say so), so that its receives cannot wait. A request that is not whole, or is traced,
is served by a follower thread, which waits for its bytes as a connection's own thread
would (and, for a connection moving large blocks, the requests that follow within
STAY_MS), then parks the connection again.

The leader never waits on one connection while others are ready: when serving would
block (a receive whose bytes have not all arrived, a reply the socket buffer does not
take at once, a put waiting for journal or backlog room: kvcommon.handoff), it first
hands the lead to a follower and finishes that request as a follower. So a peer that
stops reading, or trickles a request, holds up only its own connection, as it did with
a thread of its own; the transfer deadlines (`[bulk] min_transfer_bytes_per_s`) and the
idle timeout bound it as before.

The sealed-payload channel's requests are AEAD frames that cannot be read by a peek:
the leader serves them once the first bytes are in, and a receive that would wait for
the rest hands off first. Not on the loop: TLS (its bytes are decrypted in the
socket's own buffer), same-host arenas, connections handed to bulk workers, and
servers with a remote tier below LMDB (a read through to Redis waits on the network).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import logging
import select
import socket
import ssl
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvcommon import bulkwire as w
from kvcommon import handoff
from kvcommon.handoff import HandsOff

log = logging.getLogger(__name__)
PEEK_BYTES = 16 << 10  # a request's header and body, looked at before it is served
POLL_S = 1.0  # how often the leader looks up from epoll (stop, idle connections)
SPARE_FOLLOWERS = 4  # followers kept waiting for work, beyond those at work
SPARE_IDLE_S = 30.0  # a spare follower waits this long, then ends
# A follower serves on a connection moving large blocks (its last request moved at
# least STAY_MIN_BYTES) while its next request comes within STAY_MS.
STAY_MS = 20
STAY_MIN_BYTES = 1 << 20
_INT = struct.Struct("i")
# As plain ints: or-ing the socket module's flag enums costs ~0.5 us a request.
_PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_EVENTS = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT


class Handler(Protocol):
    """What serves a connection's requests (the listener's BulkHandler, a worker's
    Connection)."""

    @property
    def last_bytes(self) -> int:
        """Payload bytes the last request moved."""
        ...


H = TypeVar("H", bound=Handler)


@dataclass(eq=False)
class Parked(Generic[H]):
    """A connection on the loop: its socket, handler and what ends it."""

    raw: socket.socket
    fd: int  # kept: a socket closed under the loop (the server stops) reads -1
    handler: H
    close: Callable[[], None]  # closes the socket and forgets it (the listener's)
    # Requests in the plain framing, checked whole before the leader serves one; else
    # (sealed frames) served once readable, a receive that would wait handing off.
    peekable: bool = True
    since: float = field(default_factory=time.monotonic)


class ReadyLoop(Generic[H]):
    def __init__(
        self,
        serve_one: Callable[[H, memoryview | None], bool],
        idle_timeout_s: float,
        stopping: Callable[[], bool],
    ) -> None:
        """`serve_one(handler, peeked)` serves one request of a connection (False:
        close it). `peeked`: the request's header and body, still in the socket, as the
        leader peeked them (valid until serving first waits; None: not peeked, read them
        from the socket). A bulk worker's loop serves its own connections
        (cacheserver.transport.bulk.readworker)."""
        self._serve_one = serve_one
        self._idle_timeout_s = idle_timeout_s
        self._stopping = stopping
        self._epoll = select.epoll()
        self._lock = threading.Lock()
        self._parked: dict[int, Parked[H]] = {}  # by descriptor: watched by epoll now
        self._known: set[int] = set()  # descriptors registered with epoll
        self._ready: collections.deque[int] = collections.deque()  # seen, not yet served
        # The leader's look at a request before it serves it (only the leader peeks).
        self._peeked = bytearray(PEEK_BYTES)
        self._leader: threading.Thread | None = None
        self._work: collections.deque[Parked[H] | None] = collections.deque()
        self._spares = 0  # followers waiting for work or the lead
        self._wake = threading.Condition(self._lock)
        self._started = False
        self.inline_requests = 0  # served by the leader itself
        self.follower_requests = 0  # served by a follower (not whole, traced)
        self.handoffs = 0  # times the leader handed the lead on before blocking

    def adopt(
        self, raw: socket.socket, handler: H, close: Callable[[], None], *, peekable: bool = True
    ) -> None:
        """Take an authenticated plain-TCP connection; the loop closes it when it ends.
        `peekable`: its requests are in the plain framing (`_whole_request` can read
        them); the sealed channel's are not."""
        parked = Parked(raw, raw.fileno(), handler, close, peekable)
        with self._lock:
            if not self._started:
                self._started = True
                self._spawn(lead=True)
            self._known.add(parked.fd)
        self._park(parked, register=True)

    def stop(self) -> None:
        """Close every parked connection and let the threads end."""
        with self._lock:
            parked = list(self._parked.values())
            self._wake.notify_all()
        for conn in parked:
            self._end(conn)
        with contextlib.suppress(OSError):
            self._epoll.close()

    # -- the leader ----------------------------------------------------------------

    def _run(self, lead: bool) -> None:
        """A loop thread: lead while it holds the lead, follow otherwise."""
        me = threading.current_thread()
        if lead:
            with self._lock:
                self._leader = me
        try:
            while not self._stopping():
                if self._leader is me:
                    self._lead(me)
                elif not self._follow():
                    return
        except Exception:
            log.exception("the bulk ready loop failed")

    def _lead(self, me: threading.Thread) -> None:
        next_sweep = time.monotonic() + POLL_S
        # Made once, not per request: the hook, and the block that arms it around each.
        hands_off = handoff.hands_off(functools.partial(self._hand_on_lead, me))
        while self._leader is me and not self._stopping():
            if not self._ready:
                try:
                    events = self._epoll.poll(POLL_S)
                except (OSError, ValueError):
                    return  # closed: the server stops
                self._ready.extend([fd for fd, _ in events])
            while self._ready and self._leader is me:
                with self._lock:
                    parked = self._parked.pop(self._ready.popleft(), None)
                if parked is not None:
                    self._serve_ready(parked, me, hands_off)
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + POLL_S
                self._close_idle()

    def _serve_ready(self, parked: Parked[H], me: threading.Thread, hands_off: HandsOff) -> None:
        """Serve the connection's request here when it is whole, else have a follower
        serve it."""
        raw, peeked = parked.raw, None
        if parked.peekable:
            size = _whole_request(raw, self._peeked)
            whole = None if size is None else size > 0
            if whole:
                peeked = memoryview(self._peeked)[:size]
        else:
            whole = _readable_now(raw)
        if whole is None:
            self._end(parked)  # the peer closed, or its socket failed
            return
        if not whole:
            self._hand_to_follower(parked)
            return
        self.inline_requests += 1
        with hands_off:
            serves_on = self._serve(parked, peeked)
        if self._leader is not me and serves_on:  # it waited: a follower now
            serves_on = self._stay(parked)
        if serves_on:
            self._park(parked)
        else:
            self._end(parked)

    def _stay(self, parked: Parked[H]) -> bool:
        """A follower that just served a connection moving large blocks (whose requests
        arrive in pieces, whose replies outgrow the socket buffer) serves its next
        requests too, as a connection's own thread would, while they come within
        STAY_MS and stay large: one thread wake a request, not two and a lead
        hand-off. Small calls go back to the loop. False: the connection closes."""
        if parked.handler.last_bytes < STAY_MIN_BYTES:
            return True
        poller = select.poll()
        poller.register(parked.fd, select.POLLIN)
        while parked.handler.last_bytes >= STAY_MIN_BYTES and poller.poll(STAY_MS):
            self.follower_requests += 1
            if not self._serve(parked):
                return False
        return True

    def _serve(self, parked: Parked[H], peeked: memoryview | None = None) -> bool:
        try:
            return self._serve_one(parked.handler, peeked)
        except (OSError, w.ConnectionClosed, ssl.SSLError):
            return False
        except Exception:
            log.exception("bulk connection failed")
            return False

    def _hand_on_lead(self, me: threading.Thread) -> None:
        """The leader is about to wait on one connection: a follower leads from now on
        (the connections it has seen and not served yet are the new leader's)."""
        with self._lock:
            if self._leader is me:
                self._leader = None
                self.handoffs += 1
                self._give_lead()

    def _give_lead(self) -> None:
        """A spare follower takes the lead, or a new thread does (under `_lock`)."""
        self._work.appendleft(None)  # None: lead, before any connection waiting
        self._call_follower()

    def _call_follower(self) -> None:
        """A spare follower takes the work just queued, or a new thread does (under
        `_lock`): work never waits for a follower busy with a slow peer."""
        if len(self._work) <= self._spares:
            self._wake.notify()
        else:
            self._spawn(lead=False)

    def _close_idle(self) -> None:
        limit = time.monotonic() - self._idle_timeout_s
        with self._lock:
            idle = [p for p in self._parked.values() if p.since < limit]
            for parked in idle:
                del self._parked[parked.fd]
        for parked in idle:
            self._end(parked)

    # -- followers -----------------------------------------------------------------

    def _hand_to_follower(self, parked: Parked[H]) -> None:
        with self._lock:
            self._work.append(parked)
            self._call_follower()

    def _follow(self) -> bool:
        """Wait for a connection to serve or for the lead; False: end this thread."""
        with self._lock:
            if self._spares >= SPARE_FOLLOWERS and len(self._work) <= self._spares:
                return False
            self._spares += 1
            try:
                while not self._work:
                    waited = not self._stopping() and self._wake.wait(SPARE_IDLE_S)
                    if not waited and not self._work:
                        return False
                work = self._work.popleft()
                if work is None:
                    self._leader = threading.current_thread()
                    return True
            finally:
                self._spares -= 1
            self.follower_requests += 1
        if self._serve(work) and self._stay(work):
            self._park(work)
        else:
            self._end(work)
        return True

    def _spawn(self, *, lead: bool) -> None:
        threading.Thread(
            target=self._run, args=(lead,), name="kvshare-bulk-loop", daemon=True
        ).start()

    # -- parking -------------------------------------------------------------------

    def _park(self, parked: Parked[H], *, register: bool = False) -> None:
        """Watch the connection for its next request."""
        fd = parked.fd
        parked.since = time.monotonic()
        with self._lock:
            self._parked[fd] = parked
            try:
                if register:
                    self._epoll.register(fd, _EVENTS)
                else:
                    self._epoll.modify(fd, _EVENTS)
                return
            except (OSError, ValueError):
                del self._parked[fd]  # the server stops (epoll closed), or the socket did
        self._end(parked)

    def _end(self, parked: Parked[H]) -> None:
        fd = parked.fd
        with self._lock:
            self._parked.pop(fd, None)
            if fd in self._known:
                self._known.discard(fd)
                with contextlib.suppress(OSError, ValueError):
                    self._epoll.unregister(fd)  # before close: the number is reused
        parked.close()


def _whole_request(raw: socket.socket, head: bytearray) -> int | None:
    """The length of the next request's header and body, peeked into `head`, when all
    of the request is in the socket's receive buffer (and it is untraced): serving it
    cannot wait on the peer. 0: not whole; None: the peer closed, or the socket failed."""
    try:
        got = raw.recv_into(head, len(head), _PEEK_NOW)
    except BlockingIOError:
        return 0
    except OSError:
        return None
    if got == 0:
        return None
    if got < w.REQUEST.size:
        return 0
    op, model_len, count = w.REQUEST.unpack_from(head)
    if op & w.TRACED:
        return 0
    digests_end = w.REQUEST.size + model_len + w.DIGEST_BYTES * count
    if op != w.OP_PUT:
        return digests_end if digests_end <= got else 0
    body_end = digests_end + w.SIZE.size * count
    if body_end > got:
        return 0
    sizes = memoryview(head)[digests_end:body_end]
    need = body_end + sum(int(size) for (size,) in w.SIZE.iter_unpack(sizes))
    return body_end if need <= got or need <= _readable(raw) else 0


def _readable_now(raw: socket.socket) -> bool | None:
    """Whether bytes of the next request are in the socket (a receive of them waits
    only for the rest, and hands off first). None: the peer closed, or the socket
    failed."""
    try:
        got = raw.recv(1, _PEEK_NOW)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return None if not got else True


def _readable(raw: socket.socket) -> int:
    """Bytes waiting in the socket's receive buffer."""
    buffer = bytearray(_INT.size)
    try:
        fcntl.ioctl(raw.fileno(), termios.FIONREAD, buffer)
    except OSError:
        return 0
    return int(_INT.unpack(buffer)[0])
