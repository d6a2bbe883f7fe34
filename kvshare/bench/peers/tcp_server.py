"""The raw-TCP ceiling's server: a dict of pooled, page-aligned buffers behind a socket.

Run as `python -m kvshare.bench.peers.tcp_server`; prints `listening on HOST:PORT`.
One thread per connection: recv_into and sendmsg release the GIL, so for the value
sizes measured the threads overlap. Buffers come from a per-size pool, filled ahead of
timing by OP_RESERVE, so no request pays for fresh pages.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import socket
import ssl
import sys
import threading

from kvshare.bench.buffers import aligned_buffer
from kvshare.bench.peers import tcp_wire as wire


class _Store:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[bytes, tuple[mmap.mmap, int]] = {}
        self._pool: dict[int, list[mmap.mmap]] = {}

    def take(self, size_bytes: int) -> mmap.mmap:
        with self._lock:
            free = self._pool.get(size_bytes)
            if free:
                return free.pop()
        return aligned_buffer(size_bytes)

    def commit(self, key: bytes, buffer: mmap.mmap, size_bytes: int) -> None:
        with self._lock:
            old = self._values.get(key)
            self._values[key] = (buffer, size_bytes)
            if old is not None:
                self._pool.setdefault(len(old[0]), []).append(old[0])

    def lookup(self, keys: list[bytes]) -> list[tuple[mmap.mmap, int]]:
        found = []
        with self._lock:
            for key in keys:
                entry = self._values.get(key)
                if entry is None:
                    break
                found.append(entry)
        return found

    def clear(self) -> None:
        with self._lock:
            for buffer, _ in self._values.values():
                self._pool.setdefault(len(buffer), []).append(buffer)
            self._values.clear()

    def reserve(self, size_bytes: int, count: int) -> None:
        with self._lock:
            have = len(self._pool.get(size_bytes, []))
        fresh = [aligned_buffer(size_bytes) for _ in range(max(0, count - have))]
        with self._lock:
            self._pool.setdefault(size_bytes, []).extend(fresh)


def _serve_connection(sock: socket.socket, store: _Store, tls: ssl.SSLContext | None) -> None:
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError):
            sock.close()
            return
    with sock:
        _Connection(sock, store).serve()


class _Connection:
    """One client's requests, answered in order, with buffers reused across requests."""

    def __init__(self, sock: socket.socket, store: _Store) -> None:
        self._sock = sock
        self._store = store
        self._header = bytearray(wire.REQUEST.size)
        self._keys = bytearray(wire.KEY_BYTES * wire.MAX_KEYS_PER_REQUEST)
        self._reply = bytearray(wire.REPLY.size)

    def serve(self) -> None:
        while True:
            try:
                wire.recv_exact(self._sock, memoryview(self._header))
            except (wire.PeerClosed, OSError):
                return
            op, key_count, value_bytes = wire.REQUEST.unpack(self._header)
            # RESERVE's key_count counts buffers (clients x PUTs: over 4096 with 16
            # clients), not keys sent; only requests that carry keys are bounded.
            if op in wire.KEYED_OPS and key_count > wire.MAX_KEYS_PER_REQUEST:
                self._send_reply(wire.STATUS_BAD_REQUEST)
                return
            if op == wire.OP_PUT:
                self._put(self._read_keys(key_count), value_bytes)
            elif op == wire.OP_GET:
                self._get(self._read_keys(key_count))
            elif op == wire.OP_EXISTS:
                found = self._store.lookup(self._read_keys(key_count))
                self._send_reply(wire.STATUS_OK, len(found))
            else:
                if op == wire.OP_CLEAR:
                    self._store.clear()
                elif op == wire.OP_RESERVE:
                    self._store.reserve(value_bytes, key_count)
                self._send_reply(wire.STATUS_OK)

    def _read_keys(self, key_count: int) -> list[bytes]:
        view = memoryview(self._keys)[: key_count * wire.KEY_BYTES]
        wire.recv_exact(self._sock, view)
        return [bytes(view[i : i + wire.KEY_BYTES]) for i in range(0, len(view), wire.KEY_BYTES)]

    def _put(self, keys: list[bytes], value_bytes: int) -> None:
        for key in keys:
            buffer = self._store.take(value_bytes)
            wire.recv_exact(self._sock, memoryview(buffer)[:value_bytes])
            self._store.commit(key, buffer, value_bytes)
        self._send_reply(wire.STATUS_OK, len(keys))

    def _get(self, keys: list[bytes]) -> None:
        found = self._store.lookup(keys)
        total = sum(size for _, size in found)
        wire.REPLY.pack_into(self._reply, 0, wire.STATUS_OK, len(found), total)
        lengths = b"".join(wire.LENGTH.pack(size) for _, size in found)
        lengths += bytes(wire.padding(len(found)))
        views = [memoryview(buffer)[:size] for buffer, size in found]
        wire.send_buffers(self._sock, [memoryview(self._reply), lengths, *views])

    def _send_reply(self, status: int, count: int = 0) -> None:
        wire.REPLY.pack_into(self._reply, 0, status, count, 0)
        self._sock.sendall(self._reply)


def serve(host: str, port: int, tls: ssl.SSLContext | None) -> None:
    store = _Store()
    listener = socket.create_server((host, port))
    bound_host, bound_port = listener.getsockname()[:2]
    print(f"listening on {bound_host}:{bound_port}", flush=True)
    while True:
        conn, _ = listener.accept()
        wire.configure(conn)
        threading.Thread(target=_serve_connection, args=(conn, store, tls), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="raw-TCP ceiling server for kvshare bench")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tls-cert", help="PEM certificate; with --tls-key, serve TLS")
    parser.add_argument("--tls-key")
    args = parser.parse_args(argv)
    tls = None
    if args.tls_cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.host, args.port, tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
