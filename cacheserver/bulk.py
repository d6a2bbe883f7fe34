"""The bulk listener: block bytes over plain TCP or TLS, beside gRPC.

Python gRPC costs about a millisecond per call and copies each payload several times;
this listener moves payloads with one `sendmsg` straight from the memory tier (or one
copy out of LMDB) and receives them with `recv_into`, on a thread per connection, so
the GIL is released for the whole transfer. Framing: `kvcommon.bulkwire`.

Security: a connection is opened only with a ticket from `OpenBulk`, which gRPC issued
after authenticating the caller (policy.TicketBook); the connection is then bound to
that principal and tenant, and every request is admitted by `AccessPolicy.admit` and
named by `AccessPolicy.storage_key`, exactly as the gRPC handlers do. With TLS on the
gRPC port, this listener uses the same certificate (and client-certificate CA).

Same host: a second listener, on an abstract Unix socket with a random name (so no
one can claim it before the server, and only a caller told it by OpenBulk finds it),
takes the same tickets. After the handshake it hands the connection a shared-memory
arena of its own (a memfd, sealed so that the client can neither shrink nor grow it:
no access of the server's can fault), and payloads move through the arena: one copy
each way instead of two, and no TCP stack. The server copies a put's bytes out of the
arena before it checks or hashes them, so a client rewriting the arena meanwhile can
only change its own block, as if it had sent other bytes. Policy is the same code as
on TCP: each request is admitted and named by `AccessPolicy` exactly as below.

Each request is observed like an RPC (ServerTelemetry.rpc, methods `kvshare.bulk/Get`,
`kvshare.bulk/Put`, `kvshare.bulk/Hello`); a request flagged TRACED carries its
caller's trace context, so its span joins the caller's trace as a gRPC call's does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cacheserver.config import BulkConfig, LimitsConfig
from cacheserver.events import Tier
from cacheserver.store import BlockStore
from cacheserver.telemetry import ServerTelemetry
from kvcommon import bulkwire as w
from kvcommon.errors import ConfigError, InvalidArgument, KvshareError, ResourceExhausted
from kvcommon.tracing import context_from_binary
from policy import AccessPolicy, Action
from policy.tickets import Grant, TicketBook
from policy.types import ModelName, ModelTag, StorageKey, TenantId, parse_digest, parse_model

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 300.0  # an authenticated connection may idle between requests this long
# Before its ticket is accepted a peer is unauthenticated: it gets only this long to
# finish TLS and present the ticket, so idle strangers cannot hold the connection slots.
HANDSHAKE_TIMEOUT_S = 5.0
DISK_BATCH_BYTES = 64 << 20
DISCARD_CHUNK_BYTES = 1 << 20
BULK_SYSTEM = "kvshare_bulk"  # the `rpc.system` of this listener's spans
# Linux only (memfd, seals, abstract sockets): elsewhere the same-host listener is off.
SAME_HOST_SUPPORTED = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
ARENA_SEALS = (
    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if SAME_HOST_SUPPORTED else 0
)


class Arena:
    """A same-host connection's shared memory: a sealed memfd, mapped here and sent to
    the client. The seals keep its size fixed, so the server's mapping never faults."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("kvshare-bulk-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.view = memoryview(self._map)

    def placed(self, sizes: Sequence[int]) -> list[int]:
        """The offsets of a request's blocks, or InvalidArgument if they do not fit."""
        offsets, end = w.arena_offsets(sizes)
        if end > self.size:
            raise InvalidArgument(
                f"the request's {len(sizes)} payloads take {end} bytes, over this "
                f"connection's shared-memory arena of {self.size}; split the request"
            )
        return offsets

    def close_fd(self) -> None:
        """Close this side's descriptor (once: its number may be reused at once)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """Free the arena's memory now: the client may keep its descriptor after the
        connection ends, which would otherwise keep the pages alive (and unbounded by
        [bulk] max_arenas). MADV_REMOVE gives them back; the client then sees zeros."""
        self.close_fd()
        self.view.release()
        with contextlib.suppress(OSError, AttributeError):
            self._map.madvise(mmap.MADV_REMOVE)
        self._map.close()


# How a put's payload reaches its buffer: fill(target, index) writes block `index` into
# `target`; skip(index, size) passes over a block that is not wanted.
Fill = Callable[[memoryview, int], None]
Skip = Callable[[int, int], None]


class BulkServer:
    def __init__(
        self,
        host: str,
        store: BlockStore,
        policy: AccessPolicy,
        tickets: TicketBook,
        limits: LimitsConfig,
        tls: ssl.SSLContext | None = None,
        *,
        telemetry: ServerTelemetry | None = None,
        bulk: BulkConfig | None = None,
        port: int = 0,
    ) -> None:
        self._telemetry = telemetry or ServerTelemetry()
        self._bulk = bulk or BulkConfig()
        self._store = store
        self._policy = policy
        self._tickets = tickets
        self._limits = limits
        self._tls = tls
        self._listener = _bind_listener(host, port)
        _bound_host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._connections: set[socket.socket] = set()
        self._arenas = 0
        self._lock = threading.Lock()
        self._stopping = False
        self.handshake_timeout_s = HANDSHAKE_TIMEOUT_S
        self._acceptors = [
            threading.Thread(
                target=self._accept_loop,
                args=(self._listener, self._serve),
                name="kvshare-bulk-accept",
                daemon=True,
            )
        ]
        # The same-host listener, as OpenBulk describes it: its abstract socket's name
        # (without the leading NUL), its host and network namespace, the server's uid.
        self.local_address = self.local_namespace = self.local_owner = ""
        self._local_listener = self._listen_locally() if self._bulk.same_host else None
        if self._local_listener is not None:
            self._acceptors.append(
                threading.Thread(
                    target=self._accept_loop,
                    args=(self._local_listener, self._serve_local),
                    name="kvshare-bulk-accept-local",
                    daemon=True,
                )
            )

    @property
    def arenas(self) -> int:
        """Same-host connections holding an arena now."""
        with self._lock:
            return self._arenas

    def _listen_locally(self) -> socket.socket | None:
        """The same-host listener on an abstract Unix socket with a random name, or None
        (logged) where the platform has none: clients then use TCP."""
        if not SAME_HOST_SUPPORTED:
            log.warning("no same-host bulk transport on this platform (needs Linux memfd)")
            return None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"kvshare-bulk-{secrets.token_hex(16)}"
        try:
            listener.bind("\0" + name)
            listener.listen(128)
        except OSError as error:
            listener.close()
            log.warning("no same-host bulk listener (%s); clients use TCP", error.strerror)
            return None
        self.local_address = name
        self.local_namespace = w.host_namespace()
        self.local_owner = str(os.getuid())
        return listener

    def start(self) -> str:
        for acceptor in self._acceptors:
            acceptor.start()
        return self.address

    def stop(self) -> None:
        self._stopping = True
        # shutdown() wakes threads blocked in accept()/recv(); close() alone does not.
        _close_quietly(self._listener)
        if self._local_listener is not None:
            _close_quietly(self._local_listener)
        with self._lock:
            for conn in list(self._connections):
                _close_quietly(conn)
        for acceptor in self._acceptors:
            acceptor.join(timeout=5)

    def _accept_loop(self, listener: socket.socket, serve: Callable[[socket.socket], None]) -> None:
        while not self._stopping:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if len(self._connections) >= MAX_CONNECTIONS:
                    _close_quietly(conn)
                    continue
                self._connections.add(conn)
            threading.Thread(target=serve, args=(conn,), name="kvshare-bulk", daemon=True).start()

    @contextlib.contextmanager
    def _connection_scope(self, raw: socket.socket) -> Iterator[None]:
        """One accepted connection's lifetime, for both listeners: a client going away
        ends it quietly (nothing acknowledged is affected), anything else is logged;
        either way the connection slot is given back."""
        try:
            yield
        except (OSError, w.ConnectionClosed, ssl.SSLError):
            pass
        except Exception:
            log.exception("bulk connection failed")
        finally:
            self._forget(raw)

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        with self._connection_scope(raw):
            try:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                raw.settimeout(self.handshake_timeout_s)
                if self._tls is not None:
                    conn = self._tls.wrap_socket(raw, server_side=True)
                grant = self._handshake(conn)
                if grant is None:
                    return
                conn.sendall(bytes([w.OK]))
                if conn is raw:  # plain TCP: kernel timeouts, so receives can wait for all
                    w.kernel_timeouts(raw, IDLE_TIMEOUT_S)
                else:
                    conn.settimeout(IDLE_TIMEOUT_S)
                while self._serve_one(conn, grant, None):
                    pass
            finally:
                _close_quietly(conn)

    def _serve_local(self, conn: socket.socket) -> None:
        """A same-host connection: the same handshake and requests as `_serve`, with
        payloads in the connection's arena."""
        arena: Arena | None = None
        with self._connection_scope(conn):
            try:
                conn.settimeout(self.handshake_timeout_s)
                grant = self._handshake(conn)
                arena = None if grant is None else self._open_arena(conn)
                if grant is None or arena is None:
                    return
                try:
                    socket.send_fds(conn, [w.ARENA_REPLY.pack(w.OK, arena.size)], [arena.fd])
                finally:
                    arena.close_fd()  # the client holds its own descriptor now
                w.kernel_timeouts(conn, IDLE_TIMEOUT_S)
                while self._serve_one(conn, grant, arena):
                    pass
            finally:
                _close_quietly(conn)
                if arena is not None:
                    try:
                        arena.close()
                    finally:
                        with self._lock:
                            self._arenas -= 1

    def _open_arena(self, conn: socket.socket) -> Arena | None:
        """This connection's arena, or None (and an error frame) when no more may open."""
        with self._lock:
            room = self._arenas < self._bulk.max_arenas
            if room:
                self._arenas += 1
        try:
            if not room:
                raise ResourceExhausted(
                    f"all {self._bulk.max_arenas} same-host arenas are in use "
                    "([bulk] max_arenas); use the TCP listener"
                )
            return Arena(self._bulk.arena_bytes)
        except (KvshareError, OSError) as error:
            if room:
                with self._lock:
                    self._arenas -= 1
            if isinstance(error, OSError):
                log.error("cannot create a same-host arena: %s", error.strerror)
                error = ResourceExhausted("the server could not create a shared-memory arena")
            status = error.status if isinstance(error, KvshareError) else "RESOURCE_EXHAUSTED"
            conn.sendall(w.error_frame(status, str(error)))
            return None

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)

    def _handshake(self, conn: socket.socket) -> Grant | None:
        """Redeem the client's ticket; None (and an error frame sent) if it fails."""
        hello = w.recv_bytes(conn, w.HELLO.size)
        magic, ticket = w.HELLO.unpack(hello)
        with self._telemetry.rpc("kvshare.bulk/Hello", None, system=BULK_SYSTEM) as call:
            try:
                if magic != w.MAGIC:
                    raise InvalidArgument("not a kvshare bulk client (bad magic)")
                return self._tickets.redeem(ticket)
            except KvshareError as error:
                call.status = error.status
                conn.sendall(w.error_frame(error.status, str(error)))
                return None

    def _serve_one(self, conn: socket.socket, grant: Grant, arena: Arena | None) -> bool:
        """One request; False when the connection should close."""
        try:
            header = w.recv_bytes(conn, w.REQUEST.size)
        except w.ConnectionClosed:
            return False
        op, model_len, count = w.REQUEST.unpack(header)
        parent = None
        if op & w.TRACED:
            op &= ~w.TRACED
            parent = context_from_binary(w.recv_bytes(conn, w.TRACE_CONTEXT_BYTES))
        name = {w.OP_GET: "Get", w.OP_PUT: "Put"}.get(op, "Invalid")
        with self._telemetry.rpc(f"kvshare.bulk/{name}", parent, system=BULK_SYSTEM) as call:
            try:
                keys, model, sizes = self._read_request(conn, grant, op, model_len, count)
                if op == w.OP_GET:
                    if arena is None:
                        self._get(conn, grant.tenant, keys)
                    else:
                        self._get_local(conn, grant.tenant, keys, arena)
                    return True
                tag = self._policy.model_tag(grant.tenant, model)
                self._put(conn, grant.tenant, keys, sizes, tag, arena)
                return True
            except KvshareError as error:
                call.status = error.status
                conn.sendall(w.error_frame(error.status, str(error)))
                return False  # the rest of the request may be in flight: resync by closing

    def _read_request(
        self, conn: socket.socket, grant: Grant, op: int, model_len: int, count: int
    ) -> tuple[list[StorageKey], ModelName, list[int]]:
        """Admit the request from its header, then read the rest of it (model, digests,
        and a PUT's sizes) with one receive: the storage keys, the model, the sizes."""
        if op not in (w.OP_GET, w.OP_PUT):
            raise InvalidArgument(f"unknown bulk operation {op}")
        self._limits.check_digest_count(count)
        action = Action.READ if op == w.OP_GET else Action.WRITE
        self._policy.check_rate(grant.principal)
        tenant = self._policy.admit(grant.principal, grant.tenant, action)
        sizes_len = w.SIZE.size * count if op == w.OP_PUT else 0
        body = memoryview(w.recv_bytes(conn, model_len + 32 * count + sizes_len))
        model = parse_model(bytes(body[:model_len]).decode("utf-8", "replace"))
        digests = body[model_len : model_len + 32 * count]
        keys = [
            self._policy.storage_key(tenant, model, parse_digest(bytes(digests[i : i + 32]), n))
            for n, i in enumerate(range(0, len(digests), 32))
        ]
        sizes = [size for (size,) in w.SIZE.iter_unpack(body[model_len + 32 * count :])]
        for index, size in enumerate(sizes):
            self._limits.check_block_bytes(index, size)
        return keys, model, sizes

    def _get(self, conn: socket.socket, tenant: TenantId, keys: Sequence[StorageKey]) -> None:
        with self._store.reading():  # payloads may be views of journal records
            self._send_blocks(conn, tenant, keys)

    def _send_blocks(
        self, conn: socket.socket, tenant: TenantId, keys: Sequence[StorageKey]
    ) -> None:
        """The reply in as few `sendmsg` calls as its tiers allow: one for blocks all in
        memory (status, sizes, payloads and END together)."""
        parts: list[bytes | bytearray | memoryview] = [bytes([w.OK])]
        served = 0
        while served < len(keys):
            tier, payloads = self._next_payloads(tenant, keys[served:])
            if not payloads:
                break
            for payload in payloads:
                parts += [w.SIZE.pack(len(payload)), payload]
            served += len(payloads)
            self._store.note_served(tenant, tier, payloads)
            if served < len(keys):  # more may come from LMDB: send these first
                w.send_parts(conn, parts)
                parts = []
        self._store.note_get(tenant, len(keys), served)  # counted before the caller hears
        w.send_parts(conn, [*parts, w.END])

    def _next_payloads(
        self, tenant: TenantId, keys: Sequence[StorageKey]
    ) -> tuple[Tier, Sequence[Any]]:
        """The leading present blocks of `keys`: from memory, else a batch from LMDB."""
        payloads = self._store.read_from_memory(keys)
        if payloads:
            return "memory", payloads
        return "lmdb", self._store.read_from_disk(tenant, keys, DISK_BATCH_BYTES)

    def _get_local(
        self, conn: socket.socket, tenant: TenantId, keys: Sequence[StorageKey], arena: Arena
    ) -> None:
        """Copy the leading present blocks into the arena, as many as fit, then say
        their sizes (and whether the arena filled up before the next present block)."""
        sizes: list[int] = []
        offset, truncated = 0, False
        with self._store.reading():  # payloads may be views of journal records
            while len(sizes) < len(keys) and not truncated:
                tier, payloads = self._next_payloads(tenant, keys[len(sizes) :])
                if not payloads:
                    break
                placed = 0
                for payload in payloads:
                    size = len(payload)
                    if offset + size > arena.size:
                        truncated = True
                        break
                    w.copy_into(arena.view[offset:], payload)
                    sizes.append(size)
                    placed += 1
                    offset += size + (-size % w.ARENA_ALIGN)
                self._store.note_served(tenant, tier, payloads[:placed])
        # Counted before the caller hears; a truncated reply's rest is asked for again,
        # so it counts as asked then, not as missed now.
        self._store.note_get(tenant, len(sizes) if truncated else len(keys), len(sizes))
        reply = [bytes([w.OK]), w.LOCAL_GET.pack(len(sizes), truncated)]
        conn.sendall(b"".join(reply + [w.SIZE.pack(size) for size in sizes]))

    def _put(
        self,
        conn: socket.socket,
        tenant: TenantId,
        keys: Sequence[StorageKey],
        sizes: Sequence[int],
        tag: ModelTag,
        arena: Arena | None,
    ) -> None:
        fill, skip = self._payload_source(conn, sizes, arena)
        if self._store.receives_in_place:
            outcomes = self._put_in_place(tenant, keys, sizes, tag, fill, skip)
        else:
            outcomes = self._put_buffered(tenant, keys, sizes, tag, fill)
        conn.sendall(bytes([w.OK]) + outcomes)

    @staticmethod
    def _payload_source(
        conn: socket.socket, sizes: Sequence[int], arena: Arena | None
    ) -> tuple[Fill, Skip]:
        """Where a put's payloads come from: the socket, in order, or the arena."""
        if arena is None:
            return (lambda target, _index: w.recv_exact(conn, target)), (
                lambda _index, size: _discard(conn, size)
            )
        offsets = arena.placed(sizes)

        def fill(target: memoryview, index: int) -> None:
            start = offsets[index]
            w.copy_into(target, arena.view[start : start + target.nbytes])

        return fill, (lambda _index, _size: None)

    def _put_in_place(
        self,
        tenant: TenantId,
        keys: Sequence[StorageKey],
        sizes: Sequence[int],
        tag: ModelTag,
        fill: Fill,
        skip: Skip,
    ) -> bytes:
        """Move each block straight into its journal record: one copy, into memory
        whose pages exist already; acknowledged once the record is committed."""
        outcomes = bytearray()
        for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            job = self._store.begin_put(tenant, key, size, tag)
            if job is None:  # already stored: the bytes are passed over
                skip(index, size)
                outcomes.append(w.OUTCOME_ALREADY_PRESENT)
                continue
            try:
                fill(memoryview(job.payload), index)
                self._policy.check_payload(tenant, job.payload, index)
            except BaseException:
                self._store.abandon_put(job)
                raise
            stored = self._store.finish_put(job)
            outcomes.append(w.OUTCOME_STORED if stored else w.OUTCOME_ALREADY_PRESENT)
        return bytes(outcomes)

    def _put_buffered(
        self,
        tenant: TenantId,
        keys: Sequence[StorageKey],
        sizes: Sequence[int],
        tag: ModelTag,
        fill: Fill,
    ) -> bytes:
        """Without the journal: each block into its own buffer (kept by the memory
        tier), acknowledged after the LMDB commit."""
        futures = []
        for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            payload = bytearray(size)
            fill(memoryview(payload), index)  # stored as filled: no further copy
            self._policy.check_payload(tenant, payload, index)
            futures.append(self._store.submit_put(tenant, key, payload, tag))
        concurrent.futures.wait(futures)
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            raise failed
        return bytes(w.OUTCOME_STORED if f.result() else w.OUTCOME_ALREADY_PRESENT for f in futures)


def _bind_listener(host: str, port: int) -> socket.socket:
    """The TCP listener on `host:port` ([bulk] listen), or ConfigError saying what to change."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), port))
        listener.listen(128)
    except OSError as error:
        listener.close()
        reason = (
            "the port is in use"
            if error.errno == errno.EADDRINUSE
            else f"cannot bind ({error.strerror or error})"
        )
        raise ConfigError(
            f"cannot listen on {host}:{port} for the bulk channel: {reason}; set "
            "[bulk] listen or --bulk-listen (default: the --listen host at its port + 1)"
        ) from None
    return listener


def _discard(conn: socket.socket, size: int) -> None:
    """Receive and drop `size` bytes (a block the store already holds)."""
    scratch = memoryview(bytearray(min(size, DISCARD_CHUNK_BYTES)))
    while size:
        step = min(size, len(scratch))
        w.recv_exact(conn, scratch[:step])
        size -= step


def _close_quietly(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept()/recv()
    with contextlib.suppress(OSError):
        conn.close()


def server_tls_context(
    cert_chain: bytes, private_key: bytes, client_ca: bytes | None
) -> ssl.SSLContext:
    """The bulk listener's TLS context, from the same files as the gRPC port."""
    import tempfile
    from pathlib import Path

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert_path.write_bytes(cert_chain)
        key_path.write_bytes(private_key)
        key_path.chmod(0o600)
        context.load_cert_chain(cert_path, key_path)
    if client_ca is not None:
        context.load_verify_locations(cadata=client_ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    return context
