"""Micro-benchmark: what protecting the bulk channel costs, per option (docs/secure-channel.md).

    python benchmarks/secure_channel_bench.py                 # loopback
    python benchmarks/secure_channel_bench.py --two-host      # across a veth (root)
    python benchmarks/secure_channel_bench.py --json --seconds 2 --size 2MiB

One server process sends (GET) or receives (PUT) blocks of one size; the client (this
process) times whole requests of `--blocks` blocks over one connection. Modes:

- `tcp`: size header + payload, no protection (the ceiling);
- `tls`: the same inside TLS 1.3 (Python's `ssl`, OpenSSL, user space);
- `ktls`: TLS with OpenSSL's SSL_OP_ENABLE_KTLS set (Python 3.11 has no constant for it;
  the bit is set on the context); reports whether the kernel took the records over;
- `hdr`: per block an AES-256-GCM-sealed header (index, size) under a per-connection
  key, payload bytes in the clear (sealed blocks are AEAD ciphertext already);
- `gmac`: `hdr` plus a GMAC tag (AES-GCM with the header and payload as associated
  data, nothing encrypted) over header and payload: the proposed channel;
- `hmac`, `poly`: `hdr` plus HMAC-SHA256, or Poly1305 under a one-time key from
  ChaCha20 (RFC 8439 §2.6), over header and payload: the alternatives.

`--primitives` measures each primitive's per-core throughput without a network.
`--open` opens every received block as the agent does (AES-256-GCM under a tenant key,
`policy.sealing.BlockSealer`); `--open-into` uses `decrypt_into` into a reused buffer
instead of a fresh `bytes`. `--pipeline` receives in one thread while another opens;
`--streams N` splits each request over N connections (threads). Figures are MB/s of
payload (10^6 bytes/s) and the median request time; compare modes within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac as std_hmac
import json
import os
import queue
import secrets
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import hmac as crypto_hmac
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.poly1305 import Poly1305

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvshare.bench.config import format_size, parse_size  # noqa: E402
from policy.sealing import BlockSealer, Keyring, TenantKeys  # noqa: E402

MODES = ("tcp", "tls", "ktls", "hdr", "gmac", "hmac", "poly")
SSL_OP_ENABLE_KTLS = 1 << 3  # OpenSSL 3 (ssl.OP_ENABLE_KTLS from Python 3.12)
TCP_ULP = 31  # <linux/tcp.h>
REQUEST = struct.Struct(">BI")  # op, blocks
OP_GET, OP_PUT = 1, 2
HEADER = struct.Struct(">QQ")  # block counter, size
SEALED_HEADER_BYTES = HEADER.size + 16
TENANT, MODEL = "bench", "bench/model"


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("peer closed")
        view = view[got:]


def _recv(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    _recv_exact(sock, memoryview(buffer))
    return bytes(buffer)


class Framer:
    """One direction of one connection: how a block goes on the wire and is checked."""

    def __init__(self, mode: str, key: bytes, direction: bytes) -> None:
        self.mode = mode
        self.counter = 0
        subkey = std_hmac.digest(key, b"kvshare/bench/" + direction, "sha256")
        self._key = subkey
        self._aead = AESGCM(subkey)

    def _nonce(self, domain: int) -> bytes:
        return domain.to_bytes(4, "big") + self.counter.to_bytes(8, "big")

    def send(self, sock: socket.socket, payload: memoryview) -> None:
        if self.mode in ("tcp", "tls", "ktls"):
            sock.sendall(HEADER.pack(self.counter, len(payload)))
            sock.sendall(payload)
        else:
            head = self._aead.encrypt(self._nonce(0), HEADER.pack(self.counter, len(payload)), None)
            parts = [head, payload, self._tag(head, payload)]
            while parts:  # sendmsg may send part of it
                sent = sock.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                if parts and sent:
                    parts[0] = memoryview(parts[0])[sent:]
        self.counter += 1

    def recv(self, sock: socket.socket, into: memoryview) -> memoryview:
        if self.mode in ("tcp", "tls", "ktls"):
            counter, size = HEADER.unpack(_recv(sock, HEADER.size))
        else:
            head = _recv(sock, SEALED_HEADER_BYTES)
            counter, size = HEADER.unpack(self._aead.decrypt(self._nonce(0), head, None))
        if counter != self.counter:
            raise ValueError("out of order")
        payload = into[:size]
        _recv_exact(sock, payload)
        if self.mode not in ("tcp", "tls", "ktls", "hdr"):
            tag = _recv(sock, 32 if self.mode == "hmac" else 16)
            if not std_hmac.compare_digest(self._tag(head, payload), tag):
                raise ValueError("bad tag")
        self.counter += 1
        return payload

    def _tag(self, head: bytes, payload: memoryview) -> bytes:
        if self.mode == "hdr":
            return b""
        if self.mode == "gmac":
            gmac = Cipher(algorithms.AES(self._key), modes.GCM(self._nonce(1))).encryptor()
            gmac.authenticate_additional_data(head)
            gmac.authenticate_additional_data(payload)
            gmac.finalize()
            return gmac.tag
        if self.mode == "hmac":
            mac = crypto_hmac.HMAC(self._key, hashes.SHA256())
            mac.update(head)
            mac.update(payload)
            return mac.finalize()
        stream = Cipher(algorithms.ChaCha20(self._key, bytes(4) + self._nonce(1)), None)
        poly = Poly1305(stream.encryptor().update(bytes(32)))  # RFC 8439 poly1305_key_gen
        poly.update(head)
        poly.update(payload)
        return poly.finalize()


# -- server --------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    listener = socket.create_server((args.host, 0))
    context = None
    if args.mode in ("tls", "ktls"):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.cert, args.key)
        if args.mode == "ktls":
            context.options |= SSL_OP_ENABLE_KTLS
    print(f"listening on {listener.getsockname()[1]}", flush=True)
    payload = memoryview(_sealed_payload(bytes.fromhex(args.key_hex), args.size))
    while True:
        raw, _ = listener.accept()
        threading.Thread(target=_serve_one, args=(raw, context, args, payload), daemon=True).start()


def _serve_one(
    raw: socket.socket,
    context: ssl.SSLContext | None,
    args: argparse.Namespace,
    payload: memoryview,
) -> None:
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock = context.wrap_socket(raw, server_side=True) if context else raw
    key = bytes.fromhex(args.key_hex)
    out, inbound = Framer(args.mode, key, b"s2c"), Framer(args.mode, key, b"c2s")
    scratch = memoryview(bytearray(len(payload)))
    with contextlib.suppress(ConnectionError, OSError):
        while True:
            op, blocks = REQUEST.unpack(_recv(sock, REQUEST.size))
            for _ in range(blocks):
                if op == OP_GET:
                    out.send(sock, payload)
                else:
                    inbound.recv(sock, scratch)
            if op == OP_PUT:
                sock.sendall(b"\x01")


def _sealed_payload(tenant_key: bytes, size: int) -> bytes:
    """A sealed block whose plaintext is `size` bytes, as the store holds it."""
    sealer = BlockSealer(Keyring({TENANT: TenantKeys({1: tenant_key})}))
    return sealer.seal(TENANT, MODEL, bytes(32), os.urandom(size))


# -- client --------------------------------------------------------------------------


class Client:
    def __init__(self, host: str, port: int, mode: str, key: bytes, cert: str) -> None:
        raw = socket.create_connection((host, port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock: socket.socket = raw
        self.ktls = False
        if mode in ("tls", "ktls"):
            context = ssl.create_default_context(cafile=cert)
            if mode == "ktls":
                context.options |= SSL_OP_ENABLE_KTLS
            self.sock = context.wrap_socket(raw, server_hostname=host)
            with contextlib.suppress(OSError):
                self.ktls = raw.getsockopt(socket.IPPROTO_TCP, TCP_ULP, 16).rstrip(b"\0") == b"tls"
        self.inbound = Framer(mode, key, b"s2c")
        self.out = Framer(mode, key, b"c2s")

    def get(
        self, blocks: int, buffers: list[memoryview], on_block: Callable[[memoryview], None]
    ) -> None:
        self.sock.sendall(REQUEST.pack(OP_GET, blocks))
        for index in range(blocks):
            on_block(self.inbound.recv(self.sock, buffers[index % len(buffers)]))

    def put(self, blocks: int, payload: memoryview) -> None:
        self.sock.sendall(REQUEST.pack(OP_PUT, blocks))
        for _ in range(blocks):
            self.out.send(self.sock, payload)
        if _recv(self.sock, 1) != b"\x01":
            raise ValueError("no ack")


class Opener:
    """The agent's open of each received block (AES-256-GCM under the tenant key)."""

    def __init__(self, tenant_key: bytes, size: int, *, into: bool) -> None:
        self._sealer = BlockSealer(Keyring({TENANT: TenantKeys({1: tenant_key})}))
        self._aead_key = tenant_key
        self._into = memoryview(bytearray(size)) if into else None

    def open(self, sealed: memoryview) -> None:
        if self._into is None:
            self._sealer.open(TENANT, MODEL, bytes(32), sealed)
            return
        from policy import sealing

        _magic, _format, version, nonce = sealing._HEADER.unpack(sealed[: sealing.HEADER_BYTES])
        aad = sealing.associated_data(TENANT, MODEL, bytes(32), version)
        try:
            sealing._subkey(self._aead_key, nonce).decrypt_into(
                nonce[12:], sealed[sealing.HEADER_BYTES :], aad, self._into
            )
        except InvalidTag:
            raise ValueError("open failed") from None


def _timed(seconds: float, one_request: Callable[[], None]) -> list[float]:
    one_request()  # warm: connection, buffers, first pages
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        started = time.perf_counter()
        one_request()
        times.append(time.perf_counter() - started)
    return times


def measure(
    args: argparse.Namespace,
    mode: str,
    op: str,
    host: str,
    run_server: Callable[[list[str]], list[str]],
) -> dict[str, Any]:
    tenant_key = bytes.fromhex(args.key_hex)
    server = subprocess.Popen(
        run_server([sys.executable, __file__, "--serve", "--mode", mode, "--host", host,
                    "--size", str(args.size), "--key-hex", args.key_hex,
                    "--cert", args.cert, "--key", args.key]),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[-1])
        streams = [Client(host, port, mode, tenant_key, args.cert) for _ in range(args.streams)]
        opener = Opener(tenant_key, args.size, into=args.open_into) if args.open else None
        payload = memoryview(_sealed_payload(tenant_key, args.size))
        sealed_size = len(payload)  # the plaintext and the seal's header and tag
        request = _request(args, op, streams, sealed_size, opener, payload)
        times = _timed(args.seconds, request)
    finally:
        server.kill()
        server.wait()
    total = args.blocks * args.size
    return {
        "mode": mode,
        "op": op,
        "topology": "two-host" if args.two_host else "loopback",
        "block_bytes": args.size,
        "blocks_per_request": args.blocks,
        "streams": args.streams,
        "open": "into" if args.open and args.open_into else ("bytes" if args.open else "no"),
        "pipeline": args.pipeline,
        "mb_per_s": round(total * len(times) / sum(times) / 1e6, 1),
        "p50_ms": round(statistics.median(times) * 1e3, 3),
        "ktls_engaged": any(c.ktls for c in streams),
        "requests": len(times),
    }


def _request(
    args: argparse.Namespace,
    op: str,
    streams: list[Client],
    sealed_size: int,
    opener: Opener | None,
    payload: memoryview,
) -> Callable[[], None]:
    share = args.blocks // len(streams)
    buffers = [[memoryview(bytearray(sealed_size)) for _ in range(4)] for _ in streams]
    if op == "put":
        return lambda: _parallel([lambda c=c: c.put(share, payload) for c in streams])

    def get_one(index: int) -> None:
        client = streams[index]
        if opener is None:
            client.get(share, buffers[index], lambda _v: None)
        elif not args.pipeline:
            client.get(share, buffers[index], opener.open)
        else:
            _pipelined(client, share, buffers[index], opener)

    return lambda: _parallel([lambda i=i: get_one(i) for i in range(len(streams))])


def _pipelined(client: Client, blocks: int, buffers: list[memoryview], opener: Opener) -> None:
    """Receive block i+1 (this thread) while another thread opens block i."""
    ready: queue.Queue[memoryview | None] = queue.Queue(maxsize=len(buffers) - 1)
    failures: list[BaseException] = []

    def open_all() -> None:
        while (view := ready.get()) is not None:
            try:
                opener.open(view)
            except BaseException as error:  # reported below
                failures.append(error)

    worker = threading.Thread(target=open_all)
    worker.start()
    client.get(blocks, buffers, ready.put)
    ready.put(None)
    worker.join()
    if failures:
        raise failures[0]


def _parallel(calls: list[Callable[[], None]]) -> None:
    if len(calls) == 1:
        calls[0]()
        return
    threads = [threading.Thread(target=call) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# -- orchestration -------------------------------------------------------------------


@contextlib.contextmanager
def placement(two_host: bool) -> Iterator[tuple[str, Callable[[list[str]], list[str]]]]:
    """(server address, how to run the server) on loopback or across the veth."""
    if not two_host:
        yield "127.0.0.1", lambda argv: argv
        return
    from kvshare.bench import netns

    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--two-host: {reason}")
    with netns.two_hosts() as rig, rig.client.entered():
        yield rig.server.address, rig.server.command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--two-host", action="store_true")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--ops", default="get,put")
    parser.add_argument("--size", type=parse_size, default=2 << 20)
    parser.add_argument("--blocks", type=int, default=8, help="blocks per request")
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--open", action="store_true")
    parser.add_argument("--open-into", action="store_true")
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--primitives", action="store_true", help="per-core crypto only")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--mode", "--host", "--key-hex", "--cert", "--key"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if args.primitives:
        for row in primitives(args.size, max(args.rounds, 5)):
            print(f"{row['primitive']:40} {row['gb_per_s']:6.2f} GB/s per core")
        return
    args.open = args.open or args.open_into or args.pipeline
    args.key_hex = secrets.token_hex(32)
    rows = []
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp, placement(args.two_host) as (host, run_server):
        from kvshare.bench.tls import write_self_signed

        cert, key = write_self_signed(Path(tmp), host)
        args.cert, args.key = str(cert), str(key)
        for round_index in range(args.rounds):
            shift = round_index % len(modes)
            for op in args.ops.split(","):
                for mode in modes[shift:] + modes[:shift]:
                    row = measure(args, mode, op, host, run_server) | {"round": round_index}
                    rows.append(row)
                    print(f"round {round_index + 1}: {_describe(args, row)}", file=sys.stderr)
    summary = summarize(rows)
    if args.json:
        versions = {"python": sys.version.split()[0], "openssl": ssl.OPENSSL_VERSION}
        document = {"summary": summary, "rows": rows, **versions, "ktls": ktls_probe()}
        print(json.dumps(document, indent=1))
        return
    for line in summary:
        print(_describe(args, line) + f"  x tcp {line['ratio_to_tcp']:.2f}")
    print(f"kTLS: {ktls_probe()}")


def _describe(args: argparse.Namespace, row: dict[str, Any]) -> str:
    return (
        f"{row['topology']:9} {row['op']:3} {row['mode']:5} {format_size(args.size)} "
        f"x{args.blocks} streams={args.streams} open={row['open']} pipeline={args.pipeline}: "
        f"{row['mb_per_s']:8,.0f} MB/s  p50 {row['p50_ms']:6.2f} ms"
        + ("  (kTLS engaged)" if row["ktls_engaged"] else "")
    )


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per op and mode: median MB/s over rounds, and the median of the per-round ratios
    to `tcp` (figures drift between rounds on a shared machine; ratios much less)."""
    tcp = {(r["op"], r["round"]): r["mb_per_s"] for r in rows if r["mode"] == "tcp"}
    summary = []
    for key in dict.fromkeys((r["op"], r["mode"]) for r in rows):
        mine = [r for r in rows if (r["op"], r["mode"]) == key]
        ratios = [
            r["mb_per_s"] / tcp[(r["op"], r["round"])] for r in mine if (r["op"], r["round"]) in tcp
        ]
        summary.append(
            {
                k: v
                for k, v in mine[0].items()
                if k not in ("mb_per_s", "p50_ms", "requests", "round")
            }
            | {
                "mb_per_s": round(statistics.median(r["mb_per_s"] for r in mine), 1),
                "p50_ms": round(statistics.median(r["p50_ms"] for r in mine), 3),
                "ratio_to_tcp": round(statistics.median(ratios), 3) if ratios else float("nan"),
                "rounds": len(mine),
            }
        )
    return summary


def primitives(size: int, rounds: int) -> list[dict[str, Any]]:
    """Per-core throughput of each candidate primitive over one block (no network):
    the medians of `rounds` interleaved rounds of 20 calls each."""
    data, key, nonce = os.urandom(size), os.urandom(32), bytes(12)
    view, out, plain = memoryview(data), bytearray(size + 16), bytearray(size)
    aead = AESGCM(key)
    sealed = aead.encrypt(nonce, data, None)

    def gmac() -> None:
        tagger = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        tagger.authenticate_additional_data(view)
        tagger.finalize()

    def hmac_sha256() -> None:
        mac = crypto_hmac.HMAC(key, hashes.SHA256())
        mac.update(view)
        mac.finalize()

    def poly1305() -> None:
        tagger = Poly1305(key)
        tagger.update(view)
        tagger.finalize()

    def copy() -> None:
        plain[:] = view

    candidates: dict[str, Callable[[], object]] = {
        "memcpy into a reused buffer": copy,
        "GMAC (AES-GCM, all associated data)": gmac,
        "AES-256-GCM encrypt (new bytes)": lambda: aead.encrypt(nonce, data, None),
        "AES-256-GCM encrypt_into (reused)": lambda: aead.encrypt_into(nonce, data, None, out),
        "AES-256-GCM decrypt (new bytes)": lambda: aead.decrypt(nonce, sealed, None),
        "AES-256-GCM decrypt_into (reused)": lambda: aead.decrypt_into(nonce, sealed, None, plain),
        "Poly1305": poly1305,
        "HMAC-SHA256": hmac_sha256,
    }
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, call in candidates.items():
            call()
            started = time.perf_counter()
            for _ in range(20):
                call()
            seconds[name].append((time.perf_counter() - started) / 20)
    return [
        {"primitive": name, "gb_per_s": round(size / statistics.median(times) / 1e9, 2)}
        for name, times in seconds.items()
    ]


def ktls_probe() -> str:
    """Whether this kernel offers the `tls` upper-layer protocol that kTLS needs."""
    try:
        available = Path("/proc/sys/net/ipv4/tcp_available_ulp").read_text().split()
    except OSError:
        available = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        try:
            client.setsockopt(socket.IPPROTO_TCP, TCP_ULP, b"tls")
        except OSError as error:
            return f"unavailable: TCP_ULP 'tls' -> {error.strerror}; available ULPs {available}"
        finally:
            client.close()
    return f"available (ULPs {available})"


if __name__ == "__main__":
    main()
