"""LMCache's standalone server (`python -m lmcache.v1.server HOST PORT cpu`) as a peer.

LMCache lives in its own virtual environment (benchmarks/setup_lmcache.sh); kvshare
never imports it. This module speaks the server's wire format with `struct`, as read
from lmcache 0.5.6 (`lmcache/v1/protocol.py`, `lmcache/v1/server/__main__.py`):

- request: 186-byte header `iiiiiiiii150s` = command, length, memory format, dtype,
  location, 4-D shape, key (a `CacheEngineKey` string
  `model@world_size@worker_id@chunk_hash_hex@dtype`, space padded); PUT then sends
  `length` raw bytes;
- reply (GET, EXIST, HEALTH): 36-byte header `iiiiiiiii` = code (200 success, 400
  fail), length, format, dtype, 4-D shape, location; GET then sends `length` bytes.

PUT has no reply, so a PUT here is followed by an EXIST on the same connection (the
server handles one connection in order): the PUT figures include that round trip and
are acknowledged like every other system's. The server has no batch GET; a batch is
pipelined (all requests sent, then all replies read), the best its protocol allows;
so is a lookup (one EXIST per key: there is no multi-key EXIST).
It has no eviction, authentication, TLS or integrity checks.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvshare.bench.buffers import aligned_buffer
from kvshare.bench.peers import tcp_wire
from kvshare.bench.peers.base import BenchError, ServerProcess, free_loopback_port, wait_for_port
from kvshare.bench.placement import LOOPBACK, Placement

ENV_PYTHON = "KVSHARE_LMCACHE_PYTHON"
DEFAULT_VENV_PYTHON = Path.home() / ".cache" / "kvshare" / "lmcache-venv" / "bin" / "python"
SERVER_START_TIMEOUT_S = 180.0  # the server imports torch; on 2 busy cores that is slow

REQUEST = struct.Struct("iiiiiiiii150s")
REPLY = struct.Struct("iiiiiiiii")
KEY_FIELD_BYTES = 150
CMD_PUT, CMD_GET, CMD_EXIST = 1, 2, 3
CODE_SUCCESS = 200
FORMAT_BINARY = 4  # lmcache.v1.memory_management.MemoryFormat.BINARY
DTYPE_UINT8 = 6  # lmcache.v1.protocol.DTYPE_TO_INT[torch.uint8]
LOCATION_NONE = 0


def lmcache_key(digest: bytes) -> bytes:
    """The CacheEngineKey string the server parses, for one 32-byte digest."""
    text = f"kvshare-bench@1@0@{digest.hex()}@uint8".encode()
    return text.ljust(KEY_FIELD_BYTES)


def pack_request(command: int, digest: bytes, length: int) -> bytes:
    return REQUEST.pack(
        command,
        length,
        FORMAT_BINARY,
        DTYPE_UINT8,
        LOCATION_NONE,
        length,
        0,
        0,
        0,
        lmcache_key(digest),
    )


@dataclass(frozen=True)
class LmcacheClientSpec:
    host: str
    port: int

    def connect(self) -> LmcacheClient:
        sock = socket.create_connection((self.host, self.port))
        tcp_wire.configure(sock)
        return LmcacheClient(sock)


class LmcacheClient:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reply = bytearray(REPLY.size)
        self._receive: mmap.mmap = aligned_buffer(1)

    def prepare(self, value_bytes: int, blocks_per_call: int) -> None:
        if len(self._receive) < value_bytes * blocks_per_call:
            self._receive = aligned_buffer(value_bytes * blocks_per_call)

    def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        buffers: list[bytes | memoryview] = []
        for key, value in zip(keys, values, strict=True):
            buffers += [pack_request(CMD_PUT, key, len(value)), value]
        buffers.append(pack_request(CMD_EXIST, keys[-1], 0))
        tcp_wire.send_buffers(self._sock, buffers)
        code, _ = self._read_reply()
        if code != CODE_SUCCESS:
            raise BenchError("lmcache server does not hold a value right after its PUT")

    def get(self, keys: Sequence[bytes]) -> list[memoryview]:
        tcp_wire.send_buffers(self._sock, [pack_request(CMD_GET, key, 0) for key in keys])
        view = memoryview(self._receive)
        values = []
        offset = 0
        is_leading = True
        for _ in keys:  # every request gets a reply; read them all to stay in sync
            code, length = self._read_reply()
            if code != CODE_SUCCESS:
                is_leading = False
                continue
            if offset + length > len(view):
                raise BenchError(f"lmcache reply of {length} bytes exceeds the prepared buffer")
            tcp_wire.recv_exact(self._sock, view[offset : offset + length])
            if is_leading:
                values.append(view[offset : offset + length])
            offset += length
        return values

    def lookup(self, keys: Sequence[bytes]) -> int:
        """EXIST per key, pipelined (the protocol has no multi-key EXIST): the count of
        leading keys held. Every request gets a reply; all are read to stay in sync."""
        tcp_wire.send_buffers(self._sock, [pack_request(CMD_EXIST, key, 0) for key in keys])
        codes = [self._read_reply()[0] for _ in keys]
        present = 0
        while present < len(codes) and codes[present] == CODE_SUCCESS:
            present += 1
        return present

    def _read_reply(self) -> tuple[int, int]:
        tcp_wire.recv_exact(self._sock, memoryview(self._reply))
        fields = REPLY.unpack(self._reply)
        return int(fields[0]), int(fields[1])

    def close(self) -> None:
        self._sock.close()


def find_lmcache_python(explicit: str | None) -> Path | None:
    """--lmcache-python, else $KVSHARE_LMCACHE_PYTHON, else setup_lmcache.sh's default venv."""
    for candidate in (explicit, os.environ.get(ENV_PYTHON), str(DEFAULT_VENV_PYTHON)):
        if candidate:
            path = Path(candidate)
            if path.exists():
                return path
            if candidate != str(DEFAULT_VENV_PYTHON):
                return path  # named explicitly: report it missing rather than fall back
    return None


class LmcacheSystem:
    name = "lmcache"
    is_put_acknowledged = False
    supports_batch_get = True  # pipelined GETs
    supports_lookup = True  # pipelined EXISTs

    def __init__(self, python: Path | None, *, placement: Placement = LOOPBACK) -> None:
        self._python = python
        self._at = placement
        self._server: ServerProcess | None = None

    def unavailable_reason(self) -> str | None:
        if self._python is None:
            return (
                "no LMCache venv: run benchmarks/setup_lmcache.sh, then pass "
                f"--lmcache-python or set {ENV_PYTHON}"
            )
        if not self._python.exists():
            return f"{self._python} does not exist"
        probe = subprocess.run(
            [
                str(self._python),
                "-c",
                "import importlib.util as u, sys; sys.exit(u.find_spec('lmcache') is None)",
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if probe.returncode != 0:
            return f"{self._python} cannot import lmcache"
        return None

    def start(self, workdir: Path) -> LmcacheClientSpec:
        if self._python is None:
            raise BenchError("lmcache is unavailable")
        port, host = free_loopback_port(), self._at.server_host
        argv = [str(self._python), "-m", "lmcache.v1.server", host, str(port), "cpu"]
        self._server = ServerProcess.launch(
            self._at.server_command(argv), workdir / "lmcache-server.log"
        )
        try:
            wait_for_port(host, port, SERVER_START_TIMEOUT_S, self._server.process)
        except BenchError as error:
            tail = self._server.tail()
            self.stop()
            raise BenchError(f"{error}; server log: {tail}") from error
        return LmcacheClientSpec(host, port)

    def reserve(self, value_bytes: int, count: int) -> None:
        pass

    def clear(self) -> bool:
        return False  # the protocol has no delete

    def server_pids(self) -> list[int]:
        return [] if self._server is None else [self._server.pid]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
