"""A sealed PUT's payload as the server receives it (cacheserver/transport/bulk/sealed.py
`_SealedSource.fill`, kvcommon.bulkio.recv_exact_fed), over a real TCP pair on loopback
with the listener's kernel timeouts, the test playing the client with the client's side
of the same keys: the GMAC is fed each piece as it arrives, the tag is checked after
the last, a block or tag altered anywhere is refused, and a peer that drips is bounded
by the transfer's deadline."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from cacheserver.transport.bulk.sealed import _SealedSource
from kvcommon import bulkio
from kvcommon import bulkwire as w
from policy.bulkchannel import Buffer, PayloadMac, Receiver, Sender, client_side, server_side

SECRET, TICKET = os.urandom(32), os.urandom(32)
IDLE_S = 300.0
BLOCK = os.urandom((1 << 20) + 12345)


@pytest.fixture
def served() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the server's end, with kernel timeouts as the listener sets them; the client's)."""
    listener = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(listener.getsockname())
    ours, _ = listener.accept()
    listener.close()
    bulkio.kernel_timeouts(ours, IDLE_S)
    yield ours, peer
    ours.close()
    peer.close()


def _keys() -> tuple[Sender, Receiver]:
    """The client's sender and the server's receiver after one request's body frame."""
    sender, _ = client_side(SECRET, TICKET)
    _, receiver = server_side(SECRET, TICKET)
    receiver.open_header(sender.seal_header(b"a request's body"))
    return sender, receiver


class _Recording(PayloadMac):
    """The real GMAC, noting the bytes of each piece it was fed (`fed`), and "first fed"
    in `order` when it gets its first."""

    def __init__(self, inner: PayloadMac, order: list[str]) -> None:
        self._inner = inner
        self.fed: list[int] = []
        self.order = order
        self.first = threading.Event()

    def update(self, data: Buffer) -> None:
        self._inner.update(data)
        if not self.fed:
            self.order.append("first fed")
            self.first.set()
        self.fed.append(memoryview(data).nbytes)

    def verify(self, tag: Buffer) -> None:
        self._inner.verify(tag)


def _source(conn: socket.socket, mac: PayloadMac, seconds: float = 30.0) -> _SealedSource:
    return _SealedSource(conn, mac, len(BLOCK), "p", bulkio.Deadline(seconds, IDLE_S))


def test_the_gmac_is_fed_the_first_piece_before_the_rest_was_sent(
    served: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = served
    sender, receiver = _keys()
    tag = sender.payload_tag(0, BLOCK)
    order: list[str] = []
    mac = _Recording(receiver.payload_mac(0), order)
    first = 300_000
    peer.sendall(BLOCK[:first])

    def rest() -> None:  # only once the first piece was fed (or, before, after a while)
        mac.first.wait(20)
        order.append("rest sent")
        peer.sendall(BLOCK[first:] + tag)

    later = threading.Thread(target=rest, daemon=True)
    later.start()
    target = bytearray(len(BLOCK))
    source = _source(ours, mac)
    source.fill(memoryview(target))
    later.join()
    assert order == ["first fed", "rest sent"]
    assert target == BLOCK and source.consumed
    assert sum(mac.fed) == len(BLOCK) and len(mac.fed) > 1


@pytest.mark.parametrize("where", [0, 300_000, len(BLOCK) - 1, len(BLOCK), len(BLOCK) + 15])
def test_a_block_or_tag_altered_anywhere_is_refused(
    served: tuple[socket.socket, socket.socket], where: int
) -> None:
    ours, peer = served
    sender, receiver = _keys()
    wire = bytearray(BLOCK + sender.payload_tag(0, BLOCK))
    wire[where] ^= 0x01
    threading.Thread(target=peer.sendall, args=(bytes(wire),), daemon=True).start()
    with pytest.raises(w.ChannelBroken, match="failed authentication"):
        _source(ours, receiver.payload_mac(0)).fill(memoryview(bytearray(len(BLOCK))))


@pytest.mark.parametrize("piece", [1000, 65536, 700_001])
def test_a_block_in_pieces_is_received_whole_and_checked(
    served: tuple[socket.socket, socket.socket], piece: int
) -> None:
    ours, peer = served
    sender, receiver = _keys()
    wire = BLOCK + sender.payload_tag(0, BLOCK)

    def trickle() -> None:
        for start in range(0, len(wire), piece):
            peer.sendall(wire[start : start + piece])

    threading.Thread(target=trickle, daemon=True).start()
    target = bytearray(len(BLOCK))
    _source(ours, receiver.payload_mac(0)).fill(memoryview(target))
    assert target == BLOCK
    peer.sendall(b"next")
    assert ours.recv(4) == b"next"  # the tag was taken, nothing past it


def test_a_peer_that_drips_its_block_is_cut_off_by_the_transfer_deadline(
    served: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = served
    _, receiver = _keys()
    peer.sendall(BLOCK[:5000])  # moves at once; the rest drips, each byte well in time
    stop = threading.Event()

    def drip() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                time.sleep(0.05)
                peer.sendall(b"x")

    threading.Thread(target=drip, daemon=True).start()
    try:
        with pytest.raises(OSError):  # TimeoutError, or EAGAIN from the kernel's timeout
            _source(ours, receiver.payload_mac(0), seconds=0.4).fill(
                memoryview(bytearray(len(BLOCK)))
            )
    finally:
        stop.set()
    timeout = ours.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
    assert int.from_bytes(timeout[:8], "little") == int(IDLE_S)  # the idle timeout again
