"""Block values and delete stream entries read off a Redis node's socket (`Replies`),
and `Failed`, the result of a command whose node is down or answered an error.

redis-py's reader takes a value in 64 KiB-1 MiB reads, copies each into its parser and
builds a bytes object at the end: two more copies of every block, and a server reading
for four clients spent its time there. Here a `$<n>` reply header says the value's
size, and the value is received straight into one buffer of that size (35% more 2 MiB
GETs from four threads). Stream entries (`stream_entries`) are read the same way, each
within a bound: an entry larger than it is read past in pieces, never held, whatever
a writer to Redis put there. A closed connection raises `ConnectionError` (an `OSError`, as
the socket's own failures are), anything that is not Redis talking `ValueError`.

Imports no `redis`: `nodes` is that library's one home, and hands this a socket.
"""

from __future__ import annotations

import socket
from typing import TypeAlias

HEADER_READ_BYTES = 16 << 10  # what a read for a reply's header line takes
ID_BYTES = 64  # a stream entry id ("<ms>-<seq>") is at most 41 characters
FIELD_OVERHEAD_BYTES = 16  # what each field costs an entry's bound beyond its bytes
MAX_LINE_BYTES = 64 << 10  # a reply line longer than this is not Redis talking


class Failed:
    """A command's result when its node is down or answered an error (a miss)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Failed({self.reason})"


StreamEntry: TypeAlias = tuple[bytes, dict[bytes, bytes] | None]  # (id, fields; None: skipped)


class ReadBudget:
    """The bytes one read may still take in, shared by every node's replies to it: a
    value is taken while some is left (the one that crosses it too, as a read returns at
    least one block) and read past once it is spent, whatever the node announces."""

    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes


OVER_BUDGET = "over budget"  # a Failed reason: read past, the read's budget spent


class Replies:
    """The replies to pipelined GETs, read off a node's socket (module docstring):
    a value, nil, or an error (as `Failed`, reason its first word, e.g. MOVED).
    Anything else, or a line that does not end, is a broken connection (ValueError)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()  # received beyond the last reply taken

    def value(self, max_bytes: int, budget: ReadBudget | None = None) -> bytearray | Failed | None:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            size = int(rest)
            if size > max_bytes:
                self._skip(size + 2)
                return Failed("too large")
            if size < 0:
                return None
            if budget is not None:
                if budget.left <= 0:
                    self._skip(size + 2)
                    return Failed(OVER_BUDGET)
                budget.left -= size
            return self._take(size)
        if kind == b"_":  # RESP3 nil
            return None
        if kind == b"-":
            return Failed(rest.split(b" ", 1)[0].decode("ascii", "replace"))
        raise ValueError("an unexpected reply to GET")

    def stream_entries(self, max_entry_bytes: int) -> list[StreamEntry] | Failed:
        """The entries of an `XREAD` of one stream: (id, fields), fields None for an
        entry over `max_entry_bytes` (its fields, and FIELD_OVERHEAD_BYTES for each,
        counted as they arrive; the rest read past) or one without fields; [] when the
        read timed out; an error reply as `Failed`."""
        line = self._line()
        if line[:1] == b"-":
            return Failed(line[1:].split(b" ", 1)[0].decode("ascii", "replace"))
        if line in (b"*-1", b"_"):  # RESP2, RESP3: nothing arrived before BLOCK ran out
            return []
        if line not in (b"*1", b"%1"):  # RESP2: [[name, entries]]; RESP3: {name: entries}
            raise ValueError("an unexpected reply to XREAD")
        if line == b"*1" and self._line() != b"*2":
            raise ValueError("an unexpected reply to XREAD")
        self._bulk(ID_BYTES << 4)  # the stream's name
        entries = []
        for _ in range(self._count()):
            if self._line() != b"*2":
                raise ValueError("an unexpected stream entry")
            entry_id = self._bulk(ID_BYTES)
            if entry_id is None:
                raise ValueError("a stream entry id too long")
            entries.append((entry_id, self._fields(max_entry_bytes)))
        return entries

    def _fields(self, max_bytes: int) -> dict[bytes, bytes] | None:
        count = self._count(allow_nil=True)
        flat: list[bytes] = []
        left = max_bytes
        for _ in range(max(0, count)):  # every part read, to keep the connection in step
            left -= FIELD_OVERHEAD_BYTES
            part = self._bulk(max(0, left))
            if part is None or left < 0:  # over the bound: the rest is only read past
                left = -1
                continue
            left -= len(part)
            flat.append(part)
        if left < 0 or count <= 0 or count % 2:
            return None
        return dict(zip(flat[::2], flat[1::2], strict=True))

    def _count(self, *, allow_nil: bool = False) -> int:
        line = self._line()
        if allow_nil and line in (b"*-1", b"_"):
            return -1
        if line[:1] != b"*":
            raise ValueError("an unexpected reply where an array belongs")
        return int(line[1:])

    def _bulk(self, max_bytes: int) -> bytes | None:
        """A bulk string, or None when it is over `max_bytes` (read past)."""
        line = self._line()
        if line[:1] != b"$":
            raise ValueError("an unexpected reply where a string belongs")
        size = int(line[1:])
        if size < 0:
            raise ValueError("nil where a string belongs")
        if size > max_bytes:
            self._skip(size + 2)
            return None
        return bytes(self._take(size))

    def _line(self) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            if len(self._pending) > MAX_LINE_BYTES:
                raise ValueError("a reply line without an end")
            chunk = self._sock.recv(HEADER_READ_BYTES)
            if not chunk:
                raise ConnectionError("the node closed the connection")
            self._pending += chunk
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _take(self, size: int) -> bytearray:
        """`size` bytes and the CRLF after them: those already received, the rest
        received in place."""
        value = bytearray(size + 2)
        with memoryview(value) as view:
            filled = min(len(self._pending), size + 2)
            view[:filled] = self._pending[:filled]
            del self._pending[:filled]
            while filled < size + 2:
                received = self._sock.recv_into(view[filled:])
                if not received:
                    raise ConnectionError("the node closed the connection")
                filled += received
        if value[size:] != b"\r\n":
            raise ValueError("a value without its CRLF")
        del value[size:]
        return value

    def _skip(self, nbytes: int) -> None:
        """Read past `nbytes` without keeping them (at most 1 MiB held at a time)."""
        taken = min(len(self._pending), nbytes)
        del self._pending[:taken]
        nbytes -= taken
        with memoryview(bytearray(min(nbytes, 1 << 20))) as scratch:
            while nbytes:
                received = self._sock.recv_into(scratch[: min(nbytes, len(scratch))])
                if not received:
                    raise ConnectionError("the node closed the connection")
                nbytes -= received
