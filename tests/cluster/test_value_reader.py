"""Block values read off a node's socket by kvshare's own reader
(cacheserver/tiers/cluster/nodes.py).

The reader replaces redis-py's on the hot path, so it must give what redis-py gives: every
value byte-exact in the order asked, nil as None, an error reply as a miss that leaves the
connection usable, and a broken reply as a dead connection, never as a wrong value. The
first tests talk to a real cluster; the last ones feed replies through a socket pair in
awkward pieces (a header split mid-line, a value split mid-CRLF), which a real server
produces only by chance.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Iterator, Sequence

import pytest

from cacheserver.tiers.cluster.config import RedisClusterConfig
from cacheserver.tiers.cluster.nodes import ClusterNodes, Failed
from cacheserver.tiers.cluster.replies import OVER_BUDGET, ReadBudget, Replies
from kvcommon.hostport import HostPort
from kvshare.bench.redis_cluster import LocalRedisCluster
from tests.support.cluster import direct

LIMIT = 4 << 20  # the largest value a read may take in


@pytest.fixture
def nodes(cluster: LocalRedisCluster) -> Iterator[ClusterNodes]:
    seeds = tuple(HostPort("127.0.0.1", node.port) for node in cluster.nodes)
    connected = ClusterNodes(RedisClusterConfig(nodes=seeds))
    assert connected.connect()
    yield connected
    connected.close()


def put(cluster: LocalRedisCluster, values: dict[bytes, bytes]) -> None:
    client = direct(cluster)
    try:
        for name, value in values.items():
            client.set(name, value)
    finally:
        client.close()


@pytest.mark.slow
def test_values_of_every_size_come_back_byte_exact_in_the_order_asked(
    cluster: LocalRedisCluster, nodes: ClusterNodes
) -> None:
    sizes = (0, 1, 2, 1000, 16 << 10, (16 << 10) + 1, 64 << 10, 3 << 20)
    values = {f"k{i}".encode(): secrets.token_bytes(size) for i, size in enumerate(sizes)}
    put(cluster, values)
    names = [*values, b"absent"]
    names = names[::-1]  # across the three nodes, in an order that is not theirs
    got = nodes.get(names, LIMIT)
    assert got == [values.get(name) for name in names]
    assert nodes.get(names, LIMIT) == got  # the pooled connections were left clean


@pytest.mark.slow
def test_an_error_reply_is_a_miss_and_the_connection_stays_usable(
    cluster: LocalRedisCluster, nodes: ClusterNodes
) -> None:
    put(cluster, {b"{t}value": b"v" * 100})
    client = direct(cluster)
    client.rpush("{t}list", b"x")  # same slot: one pipeline, the error in its middle
    client.close()
    got = nodes.get([b"{t}value", b"{t}list", b"{t}value"], LIMIT)
    assert got[0] == got[2] == b"v" * 100
    assert isinstance(got[1], Failed) and got[1].reason == "WRONGTYPE"
    assert nodes.get([b"{t}value"], LIMIT) == [b"v" * 100]


@pytest.mark.slow
def test_a_value_over_the_limit_is_a_miss_read_past_not_taken_in(
    cluster: LocalRedisCluster, nodes: ClusterNodes
) -> None:
    """A node announcing a huge value (corrupt, or someone with write access to Redis)
    does not make the server allocate it; the values after it still arrive."""
    put(cluster, {b"{t}big": b"b" * (LIMIT + 1), b"{t}small": b"s" * 10})
    got = nodes.get([b"{t}big", b"{t}small"], LIMIT)
    assert isinstance(got[0], Failed) and got[0].reason == "too large"
    assert got[1] == b"s" * 10
    assert nodes.get([b"{t}big"], LIMIT + 1) == [b"b" * (LIMIT + 1)]  # positive control


@pytest.mark.slow
def test_a_stopped_cluster_gives_failed_results_not_exceptions(
    cluster: LocalRedisCluster,
) -> None:
    nodes = ClusterNodes(RedisClusterConfig(nodes=(HostPort("127.0.0.1", 1),)))
    assert not nodes.connect()
    assert all(isinstance(r, Failed) for r in nodes.get([b"a", b"b"], LIMIT))


# -- the reader alone, over a socket pair ------------------------------------------------


def replies_from(pieces: Sequence[bytes], close: bool = True) -> Replies:
    """A reader whose peer sends `pieces` one by one (then closes, if `close`)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)

    def send() -> None:
        with theirs:
            for piece in pieces:
                theirs.sendall(piece)
            if not close:
                threading.Event().wait(6)

    threading.Thread(target=send, daemon=True).start()
    return Replies(ours)


def test_replies_split_anywhere_are_read_whole() -> None:
    value = secrets.token_bytes(70_000)
    stream = b"$70000\r\n" + value + b"\r\n" + b"$-1\r\n" + b"_\r\n" + b"-MOVED 12 1.2.3.4:7000\r\n"
    for step in (1, 3, 7, 1 << 16):
        pieces = [stream[i : i + step] for i in range(0, len(stream), step)]
        replies = replies_from(pieces)
        assert replies.value(LIMIT) == value
        assert replies.value(LIMIT) is None
        assert replies.value(LIMIT) is None  # RESP3's nil
        moved = replies.value(LIMIT)
        assert isinstance(moved, Failed) and moved.reason == "MOVED"


@pytest.mark.parametrize(
    ("stream", "error"),
    [
        (b"$10\r\n0123", ConnectionError),  # closed inside a value
        (b"$4\r\nabcdXY", ValueError),  # no CRLF after the value
        (b"+OK\r\n", ValueError),  # not a reply GET can get
        (b"$" + b"9" * (80 << 10), ValueError),  # a header line that never ends
    ],
    ids=["closed mid-value", "no CRLF", "wrong reply type", "endless line"],
)
def test_a_broken_reply_is_an_error_never_a_value(stream: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        replies_from([stream], close=stream.startswith(b"$10")).value(LIMIT)


def test_a_spent_budget_reads_values_past_and_the_replies_after_still_parse() -> None:
    """A read's budget bounds what it takes in, whatever sizes the node announces: the
    value that crosses it is taken (a read returns at least one block), the next ones
    are read past, and the stream stays in step."""
    first, second, third = b"a" * 600, b"b" * 5000, b"c" * 10
    stream = b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in (first, second, third))
    replies = replies_from([stream, b"-MOVED 1 x\r\n"])
    budget = ReadBudget(500)
    assert replies.value(LIMIT, budget) == first
    skipped = replies.value(LIMIT, budget)
    assert isinstance(skipped, Failed) and skipped.reason == OVER_BUDGET
    assert isinstance(replies.value(LIMIT, budget), Failed)
    moved = replies.value(LIMIT, budget)
    assert isinstance(moved, Failed) and moved.reason == "MOVED"


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _entry(entry_id: bytes, *parts: bytes) -> bytes:
    return b"*2\r\n" + _bulk(entry_id) + b"*%d\r\n" % len(parts) + b"".join(map(_bulk, parts))


def test_stream_entries_over_the_bound_are_read_past_and_the_rest_parse() -> None:
    """An XREAD reply: an entry of 70,000 bytes, one of 3,000 tiny fields, one with an
    odd count, then a real one; the reader keeps only what fits and stays in step."""
    entries = [
        _entry(b"1-0", b"o", b"x", b"k", b"k" * 70_000),
        _entry(b"2-0", *[b"f"] * 3000),
        _entry(b"3-0", b"o"),
        _entry(b"4-0", b"o", b"me", b"k", b"a" * 64),
    ]
    stream = b"*1\r\n*2\r\n" + _bulk(b"kvshare:deletes") + b"*4\r\n" + b"".join(entries)
    for step in (7, 1 << 16):
        pieces = [stream[i : i + step] for i in range(0, len(stream), step)] + [b"*-1\r\n"]
        replies = replies_from(pieces)
        got = replies.stream_entries(12 << 10)
        assert got == [
            (b"1-0", None),
            (b"2-0", None),
            (b"3-0", None),
            (b"4-0", {b"o": b"me", b"k": b"a" * 64}),
        ]
        assert replies.stream_entries(12 << 10) == []  # BLOCK ran out: nothing new
