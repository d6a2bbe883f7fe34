"""A man in the middle of the bulk channel, for tests: a TCP relay on loopback.

The server announces the relay's address (`[bulk] advertise`), so clients connect to
it; it connects on to the real listener. For each connection a test may give an
`Attack`: per direction, the plan of what the stream looks like from outside (a
hello of so many bytes, length-prefixed frames, runs of raw payload bytes: all a
network attacker can see of the sealed channel), and a `tamper` function that gets
every planned segment and says what to forward instead: the same bytes, altered ones,
nothing (held back to be sent later: reordering), several (replay), or `Cut` (the
connection ends there). Past its plan a direction is relayed as it comes, or, after
`drip`, the server's next bytes trickle out one at a time (a reply that never stops
coming, yet never waits long enough for one receive to time out). Everything forwarded
is recorded, so a test can also say what never crossed the wire in clear.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from cacheserver.config import BulkConfig
from kvcommon import bulkio
from kvcommon import bulkwire as w
from tests.support.certs import Certs
from tests.support.servers import Running, Tenancy, launch

FRAME = "frame"  # a plan item: one frame (u32 length, then that many bytes)
C2S, S2C = "c2s", "s2c"
CLIENT_HELLO = w.HELLO_SEALED.size
SERVER_HELLO = 1 + w.PROOF_BYTES
TAG = 16
Plan = Sequence[int | str]  # int: that many raw bytes; FRAME: one frame
Tamper = Callable[[str, int, bytes], list[bytes]]  # (direction, segment, bytes) -> to send


class Cut(Exception):
    """Raised by a tamper function: close the connection, both ways, here."""


def untouched(direction: str, index: int, segment: bytes) -> list[bytes]:
    return [segment]


@dataclass
class Attack:
    c2s: Plan = ()
    s2c: Plan = ()
    tamper: Tamper = untouched


def get_plan(blocks: int, size: int) -> Attack:
    """A GET of `blocks` present blocks of `size` bytes: the client's hello and its two
    frames (header, body); the server's hello, per block a frame and the payload, the
    end frame. Segments of the reply: 0 hello, 1 + 2i block i's frame, 2 + 2i its payload."""
    return Attack(
        c2s=[CLIENT_HELLO, FRAME, FRAME], s2c=[SERVER_HELLO, *_each(blocks, FRAME, size), FRAME]
    )


def put_plan(blocks: int, size: int) -> Attack:
    """A PUT: the client's hello, header and body frames, then per block the payload
    (segment 3 + 2i) and its tag (4 + 2i); the server's hello and its reply frame."""
    return Attack(
        c2s=[CLIENT_HELLO, FRAME, FRAME, *_each(blocks, size, TAG)], s2c=[SERVER_HELLO, FRAME]
    )


def _each(blocks: int, first: int | str, second: int | str) -> list[int | str]:
    return [item for _ in range(blocks) for item in (first, second)]


@dataclass
class Connection:
    sent: dict[str, bytearray] = field(default_factory=lambda: {C2S: bytearray(), S2C: bytearray()})


class Mitm:
    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.upstream: tuple[str, int] | None = None
        self.attacks: list[Attack] = []  # for the next connections, in order
        self.connections: list[Connection] = []
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._drip_bytes = 0
        self._drip_every_s = 0.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        threading.Thread(target=self._accept, daemon=True).start()

    def drip(self, count: int, every_s: float) -> None:
        """From now on, relay the server's next `count` bytes (past any plan) one at a
        time, `every_s` apart."""
        with self._lock:
            self._drip_bytes, self._drip_every_s = count, every_s

    def _paced(self, direction: str, chunk: bytes) -> Iterator[tuple[bytes, float]]:
        """`chunk` in the pieces to forward, each with the pause before it."""
        while chunk:
            with self._lock:
                dripping = direction == S2C and self._drip_bytes > 0
                if dripping:
                    self._drip_bytes -= 1
            if not dripping:
                yield chunk, 0.0
                return
            yield chunk[:1], self._drip_every_s
            chunk = chunk[1:]

    def close(self) -> None:
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                _shut(sock)

    def _accept(self) -> None:
        assert self.upstream is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self._lock:
                attack = self.attacks.pop(0) if self.attacks else Attack()
                record = Connection()
                self.connections.append(record)
                self._sockets += [client, server]
            for src, dst, direction, plan in (
                (client, server, C2S, attack.c2s),
                (server, client, S2C, attack.s2c),
            ):
                args = (src, dst, plan, attack.tamper, direction, record.sent[direction])
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        plan: Plan,
        tamper: Tamper,
        direction: str,
        sent: bytearray,
    ) -> None:
        try:
            for index, item in enumerate(plan):
                segment = _segment(src, item)
                for out in tamper(direction, index, segment):
                    dst.sendall(out)
                    sent += out
            while chunk := src.recv(1 << 16):
                for piece, pause_s in self._paced(direction, chunk):
                    time.sleep(pause_s)
                    dst.sendall(piece)
                    sent += piece
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
        except (Cut, OSError):
            _shut(src)
            _shut(dst)


def _segment(sock: socket.socket, item: int | str) -> bytes:
    if item == FRAME:
        head = bytes(bulkio.recv_bytes(sock, w.FRAME.size))
        return head + bytes(bulkio.recv_bytes(sock, w.FRAME.unpack(head)[0]))
    assert isinstance(item, int)
    return bytes(bulkio.recv_bytes(sock, item))


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def flip(segment: bytes, position: int) -> bytes:
    changed = bytearray(segment)
    changed[position] ^= 0x01
    return bytes(changed)


def start_behind(mitm: Mitm, tenancy: Tenancy, certs: Certs | None) -> Running:
    """A server that announces the relay as its bulk address; the relay leads to it."""
    running = launch(tenancy, certs, bulk=BulkConfig(advertise=mitm.address))
    assert running.server.server is not None and running.server.server.bulk is not None
    mitm.start(running.server.server.bulk.address)
    return running
