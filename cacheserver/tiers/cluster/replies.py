"""Block values read off a Redis node's socket (`Replies`), and `Failed`, the result of
a command whose node is down or answered an error.

redis-py's reader takes a value in 64 KiB-1 MiB reads, copies each into its parser and
builds a bytes object at the end: two more copies of every block, and a server reading
for four clients spent its time there. Here a `$<n>` reply header says the value's
size, and the value is received straight into one buffer of that size (35% more 2 MiB
GETs from four threads). A closed connection raises `ConnectionError` (an `OSError`, as
the socket's own failures are), anything that is not Redis talking `ValueError`.

Imports no `redis`: `nodes` is that library's one home, and hands this a socket.
"""

from __future__ import annotations

import socket

HEADER_READ_BYTES = 16 << 10  # what a read for a reply's header line takes
MAX_LINE_BYTES = 64 << 10  # a reply line longer than this is not Redis talking


class Failed:
    """A command's result when its node is down or answered an error (a miss)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Failed({self.reason})"


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
