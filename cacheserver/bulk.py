"""The bulk listener: block bytes over plain TCP or TLS, beside gRPC.

Python gRPC costs about a millisecond per call and copies each payload several times;
this listener moves payloads with one `sendmsg` straight from the memory tier (or one
copy out of LMDB) and receives them with `recv_into`, on a thread per connection, so
the GIL is released for the whole transfer. Framing: `kvshare.bulkwire`.

Security: a connection is opened only with a ticket from `OpenBulk`, which gRPC issued
after authenticating the caller (policy.TicketBook); the connection is then bound to
that principal and tenant, and every request is admitted by `AccessPolicy.admit` and
named by `AccessPolicy.storage_key`, exactly as the gRPC handlers do. With TLS on the
gRPC port, this listener uses the same certificate (and client-certificate CA).

Each request is observed like an RPC (ServerTelemetry.rpc, methods `kvshare.bulk/Get`,
`kvshare.bulk/Put`, `kvshare.bulk/Hello`); a request flagged TRACED carries its
caller's trace context, so its span joins the caller's trace as a gRPC call's does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Sequence

from cacheserver.config import LimitsConfig
from cacheserver.events import Tier
from cacheserver.store import BlockStore
from cacheserver.telemetry import ServerTelemetry
from kvshare import bulkwire as w
from kvshare.errors import InvalidArgument, KvshareError
from kvshare.tracing import context_from_binary
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
    ) -> None:
        self._telemetry = telemetry or ServerTelemetry()
        self._store = store
        self._policy = policy
        self._tickets = tickets
        self._limits = limits
        self._tls = tls
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host.strip("[]"), 0))
        self._listener.listen(128)
        _bound_host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self.handshake_timeout_s = HANDSHAKE_TIMEOUT_S
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="kvshare-bulk-accept", daemon=True
        )

    def start(self) -> str:
        self._acceptor.start()
        return self.address

    def stop(self) -> None:
        self._stopping = True
        # shutdown() wakes threads blocked in accept()/recv(); close() alone does not.
        _close_quietly(self._listener)
        with self._lock:
            for conn in list(self._connections):
                _close_quietly(conn)
        self._acceptor.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if len(self._connections) >= MAX_CONNECTIONS:
                    _close_quietly(conn)
                    continue
                self._connections.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="kvshare-bulk", daemon=True
            ).start()

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw.settimeout(self.handshake_timeout_s)
            if self._tls is not None:
                conn = self._tls.wrap_socket(raw, server_side=True)
            grant = self._handshake(conn)
            if grant is not None:
                if conn is raw:  # plain TCP: kernel timeouts, so receives can wait for all
                    w.kernel_timeouts(raw, IDLE_TIMEOUT_S)
                else:
                    conn.settimeout(IDLE_TIMEOUT_S)
                while self._serve_one(conn, grant):
                    pass
        except (OSError, w.ConnectionClosed, ssl.SSLError):
            pass  # the client went away; nothing acknowledged is affected
        except Exception:
            log.exception("bulk connection failed")
        finally:
            with self._lock:
                self._connections.discard(raw)
            _close_quietly(conn)

    def _handshake(self, conn: socket.socket) -> Grant | None:
        hello = w.recv_bytes(conn, w.HELLO.size)
        magic, ticket = w.HELLO.unpack(hello)
        with self._telemetry.rpc("kvshare.bulk/Hello", None, system=BULK_SYSTEM) as call:
            try:
                if magic != w.MAGIC:
                    raise InvalidArgument("not a kvshare bulk client (bad magic)")
                grant = self._tickets.redeem(ticket)
            except KvshareError as error:
                call.status = error.status
                conn.sendall(w.error_frame(error.status, str(error)))
                return None
        conn.sendall(bytes([w.OK]))
        return grant

    def _serve_one(self, conn: socket.socket, grant: Grant) -> bool:
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
                keys, model = self._request_keys(conn, grant, op, model_len, count)
                if op == w.OP_GET:
                    self._get(conn, grant.tenant, keys)
                    return True
                self._put(conn, grant.tenant, keys, self._policy.model_tag(grant.tenant, model))
                return True
            except KvshareError as error:
                call.status = error.status
                conn.sendall(w.error_frame(error.status, str(error)))
                return False  # the rest of the request may be in flight: resync by closing

    def _request_keys(
        self, conn: socket.socket, grant: Grant, op: int, model_len: int, count: int
    ) -> tuple[list[StorageKey], ModelName]:
        if op not in (w.OP_GET, w.OP_PUT):
            raise InvalidArgument(f"unknown bulk operation {op}")
        self._limits.check_digest_count(count)
        action = Action.READ if op == w.OP_GET else Action.WRITE
        self._policy.check_rate(grant.principal)
        tenant = self._policy.admit(grant.principal, grant.tenant, action)
        model = parse_model(w.recv_bytes(conn, model_len).decode("utf-8", "replace"))
        raw = w.recv_bytes(conn, 32 * count)
        keys = [
            self._policy.storage_key(tenant, model, parse_digest(bytes(raw[i : i + 32]), n))
            for n, i in enumerate(range(0, len(raw), 32))
        ]
        return keys, model

    def _get(self, conn: socket.socket, tenant: TenantId, keys: Sequence[StorageKey]) -> None:
        with self._store.reading():  # payloads may be views of journal records
            self._send_blocks(conn, tenant, keys)

    def _send_blocks(
        self, conn: socket.socket, tenant: TenantId, keys: Sequence[StorageKey]
    ) -> None:
        conn.sendall(bytes([w.OK]))
        served = 0
        while served < len(keys):
            tier: Tier = "memory"
            payloads = self._store.read_from_memory(keys[served:])
            if not payloads:
                tier = "lmdb"
                payloads = self._store.read_from_disk(tenant, keys[served:], DISK_BATCH_BYTES)
                if not payloads:
                    break
            for payload in payloads:
                w.send_parts(conn, [w.SIZE.pack(len(payload)), payload])
            served += len(payloads)
            self._store.note_served(tenant, tier, payloads)
        self._store.note_get(tenant, len(keys), served)  # counted before the caller hears
        conn.sendall(w.END)

    def _put(
        self, conn: socket.socket, tenant: TenantId, keys: Sequence[StorageKey], tag: ModelTag
    ) -> None:
        sizes_raw = w.recv_bytes(conn, w.SIZE.size * len(keys))
        sizes = [w.SIZE.unpack_from(sizes_raw, i * w.SIZE.size)[0] for i in range(len(keys))]
        for index, size in enumerate(sizes):
            self._limits.check_block_bytes(index, size)
        if self._store.receives_in_place:
            outcomes = self._put_in_place(conn, tenant, keys, sizes, tag)
        else:
            outcomes = self._put_buffered(conn, tenant, keys, sizes, tag)
        conn.sendall(bytes([w.OK]) + outcomes)

    def _put_in_place(
        self,
        conn: socket.socket,
        tenant: TenantId,
        keys: Sequence[StorageKey],
        sizes: Sequence[int],
        tag: ModelTag,
    ) -> bytes:
        """Receive each block straight into its journal record: one copy, into memory
        whose pages exist already; acknowledged once the record is committed."""
        outcomes = bytearray()
        for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            job = self._store.begin_put(tenant, key, size, tag)
            if job is None:  # already stored: the bytes still arrive, into scratch space
                self._discard(conn, size)
                outcomes.append(w.OUTCOME_ALREADY_PRESENT)
                continue
            try:
                w.recv_exact(conn, memoryview(job.payload))
                self._policy.check_payload(tenant, job.payload, index)
            except BaseException:
                self._store.abandon_put(job)
                raise
            stored = self._store.finish_put(job)
            outcomes.append(w.OUTCOME_STORED if stored else w.OUTCOME_ALREADY_PRESENT)
        return bytes(outcomes)

    def _discard(self, conn: socket.socket, size: int) -> None:
        scratch = memoryview(bytearray(min(size, DISCARD_CHUNK_BYTES)))
        while size:
            step = min(size, len(scratch))
            w.recv_exact(conn, scratch[:step])
            size -= step

    def _put_buffered(
        self,
        conn: socket.socket,
        tenant: TenantId,
        keys: Sequence[StorageKey],
        sizes: Sequence[int],
        tag: ModelTag,
    ) -> bytes:
        """Without the journal: receive each block into its own buffer (kept by the
        memory tier) and acknowledge after the LMDB commit."""
        futures = []
        for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            payload = w.recv_bytes(conn, size)  # stored as received: no copy
            self._policy.check_payload(tenant, payload, index)
            futures.append(self._store.submit_put(tenant, key, payload, tag))
        concurrent.futures.wait(futures)
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            raise failed
        return bytes(w.OUTCOME_STORED if f.result() else w.OUTCOME_ALREADY_PRESENT for f in futures)


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
