"""GET replies whose payloads start at multiples of 64 bytes (bulkwire.ALIGNED).

The kernel's copy of a payload into a socket's buffer, and out of it on the other end,
ran ~2.5x slower when the payload began 1-31 bytes into a buffer page, as it did right
after the reply's 9-byte header (benchmarks/socket_alignment.py). A client that OpenBulk
told `aligned_payloads` flags its GETs ALIGNED and the server pads; a client that does
not flag them (one from before) gets the framing it knows.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Callable

import pytest

from cacheserver.config import BulkConfig
from kvcommon import bulkio
from kvcommon import bulkwire as w
from tests.support.bulk import MODEL, open_bulk
from tests.support.bulk_workers import assembly, served_by_workers, wait_in_lmdb
from tests.support.servers import Running

# Sizes whose ends leave every padding from 0 to 63 bytes possible between blocks.
SIZES = (1, 63, 64, 65, 4096 + 7, 100_003, 2 << 20)


def put_blocks(running: Running, sizes: tuple[int, ...] = SIZES) -> tuple[list[bytes], list[bytes]]:
    digests = [os.urandom(32) for _ in sizes]
    payloads = [os.urandom(n) for n in sizes]
    with running.client("a", bulk=False) as client:
        assert client.put("alpha", MODEL, digests, payloads) == [True] * len(sizes)
    return digests, payloads


def connect(running: Running) -> socket.socket:
    response = open_bulk(running, "a", "alpha")
    assert response.aligned_payloads  # the server says it pads flagged GETs
    host, _, port = response.address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(w.HELLO.pack(w.MAGIC, response.ticket))
    assert bulkio.recv_bytes(sock, 1)[0] == w.OK
    return sock


def get(sock: socket.socket, digests: list[bytes], flags: int) -> tuple[list[bytes], list[int]]:
    """One GET in the framing `flags` asks for, read byte by byte as the wire has it:
    the payloads, and where each started in the reply. Padding must be zeros."""
    model = MODEL.encode()
    request = w.REQUEST.pack(w.OP_GET | flags, len(model), len(digests))
    sock.sendall(request + model + b"".join(digests))
    assert bulkio.recv_bytes(sock, 1)[0] == w.OK
    position = 1
    payloads: list[bytes] = []
    starts: list[int] = []
    while True:
        (size,) = w.SIZE.unpack(bulkio.recv_bytes(sock, w.SIZE.size))
        position += w.SIZE.size
        if size == 0:
            return payloads, starts
        if flags & w.ALIGNED:
            pad = w.payload_padding(position)
            assert bytes(bulkio.recv_bytes(sock, pad)) == bytes(pad)
            position += pad
        starts.append(position)
        payloads.append(bytes(bulkio.recv_bytes(sock, size)))
        position += size


def check_both_framings(running: Running, digests: list[bytes], payloads: list[bytes]) -> None:
    with connect(running) as sock:
        got, starts = get(sock, digests, w.ALIGNED)
        assert got == payloads
        assert [start % w.PAYLOAD_ALIGN for start in starts] == [0] * len(SIZES)
        # A GET not flagged (a client from before) on the same connection: no padding,
        # each payload right after its size, as that client reads it.
        got, starts = get(sock, digests, 0)
        assert got == payloads
        assert starts[0] == 1 + w.SIZE.size
        assert [b - a for a, b in itertools.pairwise(starts)] == [
            n + w.SIZE.size for n in SIZES[:-1]
        ]


def test_an_aligned_reply_starts_every_payload_at_a_multiple_of_64(
    tenant_server: Running,
) -> None:
    digests, payloads = put_blocks(tenant_server)
    check_both_framings(tenant_server, digests, payloads)


def test_the_client_asks_for_aligned_replies_and_reads_them(tenant_server: Running) -> None:
    digests, payloads = put_blocks(tenant_server)
    with tenant_server.client("a", transport="bulk-tcp") as client:
        assert [bytes(v) for v in client.get_views("alpha", MODEL, digests)] == payloads
        assert client.get("alpha", MODEL, digests[2:5]) == payloads[2:5]
        assert client.transport_stats.bulk_fallbacks == 0
        bulk = client._bulk
        assert bulk is not None
        connections = bulk._all  # the client's own record of its connections
        assert connections and all(c.aligned for c in connections)


@pytest.mark.slow
def test_a_bulk_worker_pads_its_replies_too(start_server: Callable[..., Running]) -> None:
    """A worker answers reads from LMDB in its own process, with its own framing code
    (replies of up to 1 MiB: the 2 MiB block is left out)."""
    running = start_server(bulk=BulkConfig(workers=2))
    sizes = SIZES[:-1]
    digests, payloads = put_blocks(running, sizes)
    wait_in_lmdb(running)
    before = assembly(running).processes.reports
    with connect(running) as first, connect(running) as second:  # the second: the worker's
        for sock in (first, second):
            got, starts = get(sock, digests, w.ALIGNED)
            assert got == payloads
            assert [start % w.PAYLOAD_ALIGN for start in starts] == [0] * len(sizes)
    assert served_by_workers(running, before)  # positive control: the worker answered
