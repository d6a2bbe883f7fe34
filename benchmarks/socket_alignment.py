"""What a payload's offset in a TCP stream costs the kernel's copies, on this machine.

    python benchmarks/socket_alignment.py                  # offsets 0..4088, 2 MiB
    python benchmarks/socket_alignment.py --offsets 0,9,64 --size 8MiB --calls 200

A thread sends, for each request, `offset` header bytes and then a page-aligned
payload in one `sendmsg` (as a bulk GET reply does); the client receives them into a
page-aligned buffer. Each side's thread CPU time per reply is what the kernel's copies
cost: into the socket's buffer pages on the sender, out of them on the receiver (over
loopback both copies happen here; across hosts the receiver's depends on its NIC).

Found 2026-12-06 (issue 37): with 1-31 header bytes both copies of a 2 MiB payload cost
~2.5x as much as with 0 or 32 and more (530-660 us a side against 180-250), which the
bulk GET reply's 9-byte header paid on every block (kvcommon.bulkwire, ALIGNED).
"""

from __future__ import annotations

import argparse
import mmap
import socket
import statistics
import threading
import time

PAGE = mmap.PAGESIZE
DEFAULT_OFFSETS = (0, 1, 8, 9, 16, 24, 31, 32, 36, 48, 64, 65, 128, 1024, 4088)


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20}
    lowered = text.lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(lowered[: -len(suffix)]) * factor
    return int(text)


def touched(size: int) -> mmap.mmap:
    """A page-aligned anonymous buffer, every page faulted in."""
    buffer = mmap.mmap(-1, size)
    for offset in range(0, size, PAGE):
        buffer[offset] = 1
    return buffer


def one_offset(offset: int, size: int, calls: int) -> tuple[float, float]:
    """Sender and receiver CPU microseconds per reply with `offset` header bytes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sender_us: list[float] = []

    def serve() -> None:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(touched(size))
        parts: list[memoryview] = [memoryview(bytes(offset)), payload] if offset else [payload]
        started = time.thread_time()
        for _ in range(calls):
            conn.recv(1)
            conn.sendmsg(parts)
        sender_us.append((time.thread_time() - started) / calls * 1e6)
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    client = socket.create_connection(listener.getsockname())
    received = memoryview(touched(size + offset))
    total = size + offset
    started = time.thread_time()
    for _ in range(calls):
        client.send(b"g")
        got = 0
        while got < total:
            got += client.recv_into(received[got:total], total - got)
    receiver_us = (time.thread_time() - started) / calls * 1e6
    thread.join()
    client.close()
    listener.close()
    return sender_us[0], receiver_us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offsets", default=",".join(map(str, DEFAULT_OFFSETS)))
    parser.add_argument("--size", default="2MiB", help="payload size (e.g. 64KiB, 2MiB)")
    parser.add_argument("--calls", type=int, default=300, help="replies per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per offset")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    print(f"payload {size} bytes; CPU us per reply, median of {args.repeats} (min-max)")
    print("| header bytes | sender | receiver |")
    print("|---|---|---|")
    for offset in (int(x) for x in args.offsets.split(",")):
        runs = [one_offset(offset, size, args.calls) for _ in range(args.repeats)]
        cells = []
        for side in (0, 1):
            values = [run[side] for run in runs]
            cells.append(f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})")
        print(f"| {offset} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
