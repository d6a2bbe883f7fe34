"""A bulk read worker: a second process (and GIL) serving plain-TCP bulk reads from LMDB.

    python -m cacheserver.transport.bulk.readworker --control-fd FD --buckets-fd FD \
        --slots JSON --lmdb DIR --map-bytes N

The server (cacheserver.transport.bulk.processes) starts it and hands it connections that
are past their hello (authenticated and bound to a principal and tenant by the
server: a worker never sees a ticket or a credential). Per request, the worker
answers only what it can answer exactly as the server would:

- a LOOKUP, or a GET of at most MAX_GET_BYTES, whose every block is committed in LMDB
  (a consistent snapshot in one read transaction), admitted by the request core's own
  admission, run here on the grants the server delegated with the connection (rate
  drawn from the buckets the server shares, policy.ratelimit.SharedBuckets; tenant and
  action by policy.permissions' rule; limits; model and digests; names from the
  tenant's naming key), each block's checksum verified before it is sent: the core as
  a worker runs it, cacheserver.core.readonly, which this module only frames for;
- anything else it hands back, unread: it only peeks at a request (MSG_PEEK), so the
  request is still whole at the head of the socket, and the server, which kept its own
  descriptor of the connection, reads and serves it as if it had never left (puts,
  misses, blocks still only in the put journal, refusals and their audit records,
  traced requests, bodies too large to peek at). The worker waits for the server's
  answer before it reads the connection again.

Two rules keep a worker's reads what the server's would be, and LMDB's reader table
(shared by every process, cacheserver.tiers.lmdb) free:

- A read transaction never waits on the peer. The blocks are verified and the reply
  goes out straight from the memory map as far as the socket buffer takes it at once
  (no copy: the usual case for a reader that keeps up); only what it did not take is
  copied out, and the transaction ends before the send waits. A reader that stalls
  then holds a follower thread and a copy of at most MAX_GET_BYTES, not a snapshot,
  a reader slot and every page freed after it, as it did while the transaction
  lasted as long as the send. (Copying every reply out would cost a copy per block
  on every GET; holding the transaction for a bounded time would still let
  stalled readers hold every slot for that long.)
- A block the server's index no longer lists is not served: a journaled put's
  eviction drops it from the index at once but from LMDB only when that put is
  drained. The server marks such keys in a shared table until their delete commits
  (cacheserver.tiers.retiring); the worker asks it before it takes its snapshot (a
  few array reads per request) and hands a marked key's request back, so the server's
  index answers it.

So every write, quota, eviction, journal record, audit record and refusal stays in the
server process; a worker writes nothing. What it served, counted as the store's
events (cacheserver.core.served), it reports every REPORT_INTERVAL_S: the keys become
recently used in the server's index, and the events are replayed into the server's
metrics and Stats. The worker exits when its
control socket closes (the server stopped or died).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from cacheserver.core.readonly import BoundCore, ReadOnlyCore
from cacheserver.core.served import EventSums
from cacheserver.core.values import Begun, Verb, parse_model_bytes
from cacheserver.transport.bulk import delegation as d
from cacheserver.transport.bulk.handler import VERBS, Pace
from cacheserver.transport.bulk.listener import IDLE_TIMEOUT_S
from cacheserver.transport.bulk.readyloop import ReadyLoop
from kvcommon import bulkio, handoff
from kvcommon import bulkwire as w
from kvcommon.errors import KvshareError, ResourceExhausted
from kvcommon.logs import configure_logging
from policy.ratelimit import SharedBuckets

log = logging.getLogger(__name__)
# A request's header and body are peeked at whole: at most this many bytes, well
# inside a socket's receive buffer (1,000 digests); a larger one is handed back.
MAX_PEEK_BYTES = 32 << 10
# A GET of more bytes goes back to the server: it serves large blocks from its memory
# tier (a worker's first read of LMDB pages faults each one in, and it checksums every
# byte), and large transfers are few calls, where one process is not the limit.
MAX_GET_BYTES = 1 << 20
# A datagram from the server: a delegation, or an update whose rate slots name every
# principal (some tens of bytes each).
MAX_CONTROL_BYTES = 1 << 20
# What a worker answers: reads. Everything else (puts, traced requests) is the server's.
ANSWERED = (Verb.LOOKUP, Verb.GET)
# Plain ints: or-ing socket's flag enums costs microseconds a call.
_PEEK = int(socket.MSG_PEEK)
_PEEK_ALL = int(socket.MSG_PEEK | socket.MSG_WAITALL)
_OK = bytes([w.OK])
Parts = list[bytes | bytearray | memoryview]


class Connection:
    """One delegated connection: peek, answer or hand back, until it closes."""

    def __init__(
        self, conn: socket.socket, handback: socket.socket, core: BoundCore, pace: Pace
    ) -> None:
        self._conn = conn
        self._handback = handback
        self._core = core
        self._pace = pace
        self._scratch = bytearray(MAX_PEEK_BYTES)
        self._puts_in_a_row = 0
        self.last_bytes = 0  # at most MAX_GET_BYTES: the ready loop never stays with it

    def close(self) -> None:
        for sock in (self._conn, self._handback):
            with contextlib.suppress(OSError):
                sock.close()

    def serve_one(self, peeked: memoryview | None = None) -> bool:
        """The request at the head of the socket, answered or handed back; False: the
        connection is done here (closed, given back, or failed). `peeked`: its header
        and body as the ready loop peeked them (else peeked here)."""
        head = bytes(peeked) if peeked is not None else self._peek_next()
        if head is None:
            return False
        op, model_len, count = w.REQUEST.unpack_from(head)
        aligned = bool(op & w.ALIGNED)
        op &= ~w.ALIGNED
        size = w.REQUEST.size + model_len + w.DIGEST_BYTES * count
        self._puts_in_a_row = self._puts_in_a_row + 1 if op == w.OP_PUT else 0
        if self._puts_in_a_row >= d.GIVE_BACK_AFTER_PUTS:
            self._handback.sendall(d.GIVE_BACK)
            return False  # the server serves this request and the rest
        verb = VERBS.get(op)
        if verb is None or verb not in ANSWERED or count < 1 or size > MAX_PEEK_BYTES:
            return self._hand_back(rate_drawn=False)
        try:
            begun = self._core.begin(verb, count)
        except ResourceExhausted:  # the rate's: not drawn, the server draws and refuses
            return self._hand_back(rate_drawn=False)
        except KvshareError:  # the server refuses it, with its message and audit record
            return self._hand_back(rate_drawn=True)
        request = head[:size] if len(head) >= size else self._peek(size)
        if request is None:
            return False
        try:
            answered = self._answer(begun, request, model_len, aligned)
        except KvshareError:
            answered = False  # the server refuses it, with its message
        if not answered:
            return self._hand_back(rate_drawn=True)
        return True

    def _answer(self, begun: Begun, request: bytes, model_len: int, aligned: bool) -> bool:
        """Serve the peeked request if the core answers it whole; False: not (the
        server answers it). `aligned`: a GET's reply pads its payloads (bulkwire)."""
        body = memoryview(request)[w.REQUEST.size :]
        model = parse_model_bytes(body[:model_len])
        digests = w.request_digests(body[model_len:])
        if begun.verb is Verb.LOOKUP:
            present = self._core.lookup(begun, model, digests)
            if present is None:
                return False
            self._consume(len(request))
            bulkio.send_parts(self._conn, [w.lookup_reply(present)], self._pace.deadline(0))
            return True
        whole = self._core.get(begun, model, digests, MAX_GET_BYTES)
        if whole is None:
            return False
        with whole:
            deadline = self._pace.deadline(whole.nbytes)
            rest = self._send_now(whole.views, len(request), aligned)
        if rest:  # the peer is slower than the socket buffer: wait, with no snapshot held
            bulkio.send_parts(self._conn, rest, deadline)
        return True

    def _send_now(self, views: Sequence[memoryview], request_bytes: int, aligned: bool) -> Parts:
        """Within the GET's read transaction: the request consumed, and as much of the
        reply sent as the socket takes at once, straight from the memory map; what it
        did not take is copied out before the transaction ends. Returns that rest
        (empty: all sent).

        So a read transaction, and its slot in LMDB's reader table, never waits on the
        peer: a slow or stalled reader cannot hold a snapshot (and the pages freed
        after it) or fill the table every process shares."""
        self._consume(request_bytes)
        parts: list[memoryview] = [memoryview(_OK)]
        position = len(_OK)
        for view in views:
            header, position = w.block_header(view.nbytes, position, aligned)
            parts += [memoryview(header), view]
        parts.append(memoryview(w.END))
        bulkio.send_now(self._conn, parts)
        return [b"".join(parts)] if parts else []

    def _hand_back(self, *, rate_drawn: bool) -> bool:
        """The server serves the request at the head of the socket; True when the
        connection serves on."""
        self._handback.sendall(d.HAND_BACK + (d.RATE_DRAWN if rate_drawn else b""))
        handoff.before_blocking()  # the loop's other connections go on meanwhile
        return self._handback.recv(1) == d.SERVED_ON

    def _peek_next(self) -> bytes | None:
        """What the socket holds of the next request (at least its header), left in the
        socket; None when the peer closed. Usually the whole request in one call: a
        client sends a request's header and body together."""
        got = self._conn.recv_into(self._scratch, MAX_PEEK_BYTES, _PEEK)
        if got >= w.REQUEST.size:
            return bytes(memoryview(self._scratch)[:got])
        return None if got == 0 else self._peek(w.REQUEST.size)

    def _peek(self, size: int) -> bytes | None:
        """The next `size` bytes, left in the socket; None when the peer closed first.
        Waits for them as a receive would (the connection's kernel timeouts bound it)."""
        view = memoryview(self._scratch)[:size]
        got = self._conn.recv_into(view, size, _PEEK_ALL)
        return bytes(view[:got]) if got == size else None

    def _consume(self, size: int) -> None:
        bulkio.recv_exact(self._conn, memoryview(self._scratch)[:size])


class Worker:
    def __init__(self, control: socket.socket, core: ReadOnlyCore, served: EventSums) -> None:
        self._control = control
        self._core = core
        self._served = served
        self._stopped = threading.Event()
        # Its connections on a ready loop of its own, as the server's: no thread each.
        self._loop: ReadyLoop[Connection] = ReadyLoop(
            Connection.serve_one, IDLE_TIMEOUT_S, self._stopped.is_set
        )

    def run(self) -> None:
        threading.Thread(
            target=self._report_loop, name="kvshare-worker-report", daemon=True
        ).start()
        try:
            while True:
                message, fds, _flags, _addr = socket.recv_fds(self._control, MAX_CONTROL_BYTES, 2)
                if not message:
                    return  # the server closed our control socket: it stopped or died
                if message.startswith(d.SETTINGS):
                    self._update(message, fds)
                else:
                    self._start_connection(message, fds)
        except OSError:
            return
        finally:
            self._stopped.set()

    def _start_connection(self, message: bytes, fds: list[int]) -> None:
        socks = [socket.socket(fileno=fd) for fd in fds]
        try:
            delegation = d.Delegation.decode(message)
            grants = delegation.grants()
            conn, handback = socks
        except (ValueError, TypeError, KeyError):
            log.error("a malformed delegation from the server; connection dropped")
            for sock in socks:
                sock.close()
            return
        pace = Pace(delegation.min_transfer_bytes_per_s, delegation.idle_s)
        served = Connection(conn, handback, self._core.bind(grants), pace)
        self._loop.adopt(conn, served, served.close)

    def _update(self, message: bytes, fds: list[int]) -> None:
        """A live reload's defaults and rate slots: every connection's next request
        is admitted with them."""
        for fd in fds:  # an update carries none
            socket.socket(fileno=fd).close()
        try:
            update = d.Update.decode(message)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            log.error("a malformed update from the server; ignored")
            return
        self._core.update(update.defaults, update.slots)

    def _report_loop(self) -> None:
        while not self._stopped.wait(d.REPORT_INTERVAL_S):
            try:
                for datagram in d.encode_reports(self._served.take()):
                    self._control.sendall(datagram)
            except OSError:
                return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cacheserver.transport.bulk.readworker")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--buckets-fd", type=int, required=True)
    parser.add_argument("--slots", required=True, help="JSON: principal name -> bucket slot")
    parser.add_argument("--lmdb", type=Path, required=True)
    parser.add_argument("--map-bytes", type=int, required=True)
    parser.add_argument("--log-format", default="text")
    args = parser.parse_args(argv)
    configure_logging("info", args.log_format)
    control = socket.socket(fileno=args.control_fd)
    buckets = SharedBuckets.attach(args.buckets_fd, json.loads(args.slots))
    served = EventSums()
    core = ReadOnlyCore(args.lmdb, args.map_bytes, buckets, served)
    try:
        Worker(control, core, served).run()
    finally:
        core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
