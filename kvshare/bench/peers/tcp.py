"""The raw-TCP ceiling as a benchmarked system: its server process and its client."""

from __future__ import annotations

import mmap
import socket
import ssl
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvshare.bench.buffers import aligned_buffer
from kvshare.bench.peers import tcp_wire as wire
from kvshare.bench.peers.base import BenchError, ServerProcess
from kvshare.bench.placement import LOOPBACK, Placement


@dataclass(frozen=True)
class TcpClientSpec:
    host: str
    port: int
    tls_ca_path: str | None = None

    def connect(self) -> TcpClient:
        sock = socket.create_connection((self.host, self.port))
        wire.configure(sock)
        if self.tls_ca_path is not None:
            context = ssl.create_default_context(cafile=self.tls_ca_path)
            sock = context.wrap_socket(sock, server_hostname=self.host)
        return TcpClient(sock)


class TcpClient:
    """Receives into one reused page-aligned buffer; allocates nothing per request."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reply = bytearray(wire.REPLY.size)
        self._lengths = bytearray(wire.LENGTH.size * wire.MAX_KEYS_PER_REQUEST + wire.VALUE_ALIGN)
        self._receive: mmap.mmap = aligned_buffer(1)

    def prepare(self, value_bytes: int, blocks_per_call: int) -> None:
        self._ensure_capacity(value_bytes * blocks_per_call)

    def _ensure_capacity(self, total_bytes: int) -> None:
        if len(self._receive) < total_bytes:
            self._receive = aligned_buffer(total_bytes)

    def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        value_bytes = len(values[0]) if values else 0
        header = wire.REQUEST.pack(wire.OP_PUT, len(keys), value_bytes)
        wire.send_buffers(self._sock, [header, b"".join(keys), *values])
        self._read_status()

    def get(self, keys: Sequence[bytes]) -> list[memoryview]:
        header = wire.REQUEST.pack(wire.OP_GET, len(keys), 0)
        wire.send_buffers(self._sock, [header, b"".join(keys)])
        count, total = self._read_status()
        lengths_end = count * wire.LENGTH.size
        wire.recv_exact(self._sock, memoryview(self._lengths)[: lengths_end + wire.padding(count)])
        lengths_view = memoryview(self._lengths)[:lengths_end]
        self._ensure_capacity(total)
        view = memoryview(self._receive)
        wire.recv_exact(self._sock, view[:total])
        values = []
        offset = 0
        for (length,) in wire.LENGTH.iter_unpack(lengths_view):
            values.append(view[offset : offset + length])
            offset += length
        return values

    def lookup(self, keys: Sequence[bytes]) -> int:
        header = wire.REQUEST.pack(wire.OP_EXISTS, len(keys), 0)
        wire.send_buffers(self._sock, [header, b"".join(keys)])
        count, _ = self._read_status()
        return count

    def control(self, op: int, key_count: int = 0, value_bytes: int = 0) -> None:
        wire.send_buffers(self._sock, [wire.REQUEST.pack(op, key_count, value_bytes)])
        self._read_status()

    def _read_status(self) -> tuple[int, int]:
        wire.recv_exact(self._sock, memoryview(self._reply))
        status, count, total = wire.REPLY.unpack(self._reply)
        if status != wire.STATUS_OK:
            raise BenchError(f"tcp server answered status {status}")
        return count, total

    def close(self) -> None:
        self._sock.close()


class TcpSystem:
    """The ceiling: a plain socket server in Python with no auth, eviction or integrity."""

    is_put_acknowledged = True
    supports_batch_get = True
    supports_lookup = True  # OP_EXISTS: the keys of a GET, a reply header with the count

    def __init__(self, *, tls: bool = False, placement: Placement = LOOPBACK) -> None:
        self.name = "tcp-tls" if tls else "tcp"
        self._tls = tls
        self._at = placement
        self._server: ServerProcess | None = None
        self._control: TcpClient | None = None

    def unavailable_reason(self) -> str | None:
        return None

    def start(self, workdir: Path) -> TcpClientSpec:
        argv = [sys.executable, "-m", "kvshare.bench.peers.tcp_server", "--port", "0"]
        argv += ["--host", self._at.server_host]
        ca_path = None
        if self._tls:
            from kvshare.bench.tls import write_self_signed

            cert_path, key_path = write_self_signed(workdir, self._at.server_host)
            argv += ["--tls-cert", str(cert_path), "--tls-key", str(key_path)]
            ca_path = str(cert_path)
        self._server = ServerProcess.launch(
            self._at.server_command(argv), workdir / f"{self.name}-server.log"
        )
        match = self._server.wait_for_line(r"listening on ([\d.]+):(\d+)")
        spec = TcpClientSpec(match.group(1), int(match.group(2)), ca_path)
        self._control = spec.connect()
        return spec

    def reserve(self, value_bytes: int, count: int) -> None:
        """Pre-fault the server's buffers for the next PUT cell (untimed)."""
        if self._control is not None:
            self._control.control(wire.OP_RESERVE, count, value_bytes)

    def clear(self) -> bool:
        if self._control is None:
            return False
        self._control.control(wire.OP_CLEAR)
        return True

    def server_pids(self) -> list[int]:
        return [] if self._server is None else [self._server.pid]

    def stop(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._server is not None:
            self._server.stop()
            self._server = None
