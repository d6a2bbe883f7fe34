"""A socket that counts its receive calls: a test shows how many system calls a frame
or a request took, with the real socket doing the work."""

from __future__ import annotations

import socket
from typing import Any


class CountingSocket:
    """Delegates to `sock`; `receives` counts recv, recv_into and recvmsg_into calls
    (peeks included: each is a system call)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.receives = 0

    def recv(self, *args: Any) -> bytes:
        self.receives += 1
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> int:
        self.receives += 1
        return self._sock.recv_into(*args)

    def recvmsg_into(self, *args: Any) -> Any:
        self.receives += 1
        return self._sock.recvmsg_into(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
