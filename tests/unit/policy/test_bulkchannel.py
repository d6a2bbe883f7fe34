"""The sealed-payload bulk channel's frames (policy.bulkchannel): what an attacker on
the network can do to them is refused, and only that."""

from __future__ import annotations

import os

import pytest

from policy.bulkchannel import (
    TAG_BYTES,
    ChannelError,
    Receiver,
    Sender,
    client_side,
    new_channel_secret,
    server_side,
)

TICKET = os.urandom(32)  # policy.tickets.TICKET_BYTES


Side = tuple[Sender, Receiver]


def pair() -> tuple[Side, Side]:
    secret = new_channel_secret()
    return client_side(secret, TICKET), server_side(secret, TICKET)


def test_headers_and_payload_tags_round_trip_and_hide_the_header() -> None:
    (client_out, client_in), (server_out, server_in) = pair()
    server_in.check_hello(client_out.hello_proof())
    client_in.check_hello(server_out.hello_proof())
    header = b"PUT model digest-0 digest-1 sizes"
    frame = client_out.seal_header(header)
    assert header not in frame and len(frame) == len(header) + TAG_BYTES
    blocks = [os.urandom(1000), os.urandom(2000)]
    tags = [client_out.payload_tag(i, b) for i, b in enumerate(blocks)]
    assert server_in.open_header(frame) == header
    for i, (block, tag) in enumerate(zip(blocks, tags, strict=True)):
        server_in.check_payload(i, memoryview(block), tag)
    reply = server_out.seal_header(b"OK stored stored")
    assert client_in.open_header(reply) == b"OK stored stored"


def flipped(data: bytes, position: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 0x01
    return bytes(changed)


@pytest.mark.parametrize("position", [0, 5, -TAG_BYTES, -1])
def test_a_tampered_header_is_refused(position: int) -> None:
    (client_out, _), (_, server_in) = pair()
    frame = client_out.seal_header(b"GET model digests")
    with pytest.raises(ChannelError):
        server_in.open_header(flipped(frame, position))


def test_a_truncated_header_is_refused() -> None:
    (client_out, _), (_, server_in) = pair()
    frame = client_out.seal_header(b"GET model digests")
    with pytest.raises(ChannelError):
        server_in.open_header(frame[:-1])


def test_replayed_reordered_and_reflected_headers_are_refused() -> None:
    (client_out, _), (_, server_in) = pair()
    client_out.seal_header(b"request 1")
    second = client_out.seal_header(b"request 2")
    with pytest.raises(ChannelError):  # reordered (or the first dropped): 2 arrives first
        server_in.open_header(second)
    (client_out, _), (_, server_in) = pair()
    first = client_out.seal_header(b"request 1")
    assert server_in.open_header(first) == b"request 1"
    with pytest.raises(ChannelError):  # replayed
        server_in.open_header(first)
    (client_out, client_in), (_, _) = pair()
    with pytest.raises(ChannelError):  # the client's own frame sent back to it
        client_in.open_header(client_out.seal_header(b"request 1"))


def test_a_frame_from_another_connection_is_refused() -> None:
    (client_out, _), _ = pair()
    (_, other_server_in) = server_side(new_channel_secret(), TICKET)
    with pytest.raises(ChannelError):
        other_server_in.open_header(client_out.seal_header(b"request"))
    (_, other_ticket_in) = server_side(new_channel_secret(), os.urandom(32))
    with pytest.raises(ChannelError):  # a proof for another ticket
        other_ticket_in.check_hello(client_out.hello_proof())


def test_swapped_altered_truncated_or_moved_payloads_are_refused() -> None:
    blocks = [os.urandom(4096), os.urandom(4096)]
    (client_out, _), (_, server_in) = pair()
    frame = client_out.seal_header(b"PUT two blocks")
    tags = [client_out.payload_tag(i, b) for i, b in enumerate(blocks)]
    server_in.open_header(frame)
    attempts = [
        (0, blocks[1], tags[1]),  # swapped blocks, each with its own tag
        (1, blocks[0], tags[0]),
        (0, flipped(blocks[0], 100), tags[0]),  # altered
        (0, blocks[0][:-1], tags[0]),  # truncated
        (0, blocks[0], flipped(tags[0], 0)),  # forged tag
    ]
    for index, block, tag in attempts:
        with pytest.raises(ChannelError):
            server_in.check_payload(index, block, tag)
    server_in.check_payload(0, blocks[0], tags[0])  # positive control: the real one passes
    # A tag of this block in an earlier request of the connection does not carry over.
    next_frame = client_out.seal_header(b"PUT the same block again")
    server_in.open_header(next_frame)
    with pytest.raises(ChannelError):
        server_in.check_payload(0, blocks[0], tags[0])


def test_a_hello_without_the_secret_is_refused() -> None:
    (_, _), (_, server_in) = pair()
    (impostor_out, _) = client_side(new_channel_secret(), TICKET)
    with pytest.raises(ChannelError):
        server_in.check_hello(impostor_out.hello_proof())


def test_a_payload_checked_as_it_arrives_needs_the_same_tag() -> None:
    """The server checks a PUT payload piece by piece (PayloadMac) as it receives it."""
    block = os.urandom(3 * 4096 + 17)
    (client_out, _), (_, server_in) = pair()
    server_in.open_header(client_out.seal_header(b"PUT one block"))
    tag = client_out.payload_tag(0, block)

    def check(index: int, data: bytes, with_tag: bytes, piece: int = 1000) -> None:
        mac = server_in.payload_mac(index)
        for start in range(0, len(data), piece):
            mac.update(memoryview(data)[start : start + piece])
        mac.verify(with_tag)

    check(0, block, tag)  # positive control, in pieces of any size
    check(0, block, tag, piece=len(block))
    for index, data, with_tag in [
        (1, block, tag),  # another position
        (0, flipped(block, 5000), tag),  # altered
        (0, block[:-1], tag),  # truncated
        (0, block, flipped(tag, 15)),  # forged tag
    ]:
        with pytest.raises(ChannelError):
            check(index, data, with_tag)


def test_a_connection_whose_keys_are_used_up_refuses_to_send_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No nonce repeats under one key: past MAX_HEADERS_PER_CONNECTION a side stops."""
    from policy import bulkchannel

    monkeypatch.setattr(bulkchannel, "MAX_HEADERS_PER_CONNECTION", 3)
    (client_out, _), (_, server_in) = pair()
    for n in (1, 2):
        assert server_in.open_header(client_out.seal_header(b"request %d" % n)) == b"request %d" % n
    with pytest.raises(ChannelError):
        client_out.seal_header(b"request 3")
