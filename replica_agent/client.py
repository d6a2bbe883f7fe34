"""`BlockClient`: the Python client of the kvshare block store (DESIGN §9 names).

    c = BlockClient("127.0.0.1:50051", token="...")   # tls=ClientTls(...) for TLS/mTLS
    c.put(tenant, model, digests, payloads)           # -> list[bool]: True = newly stored
    c.lookup(tenant, model, digests) -> int           # leading digests present
    c.get(tenant, model, digests) -> list[bytes]      # leading present payloads
    c.close()

Misses are results: `lookup` counts, `get` returns the leading blocks that exist.
Errors raise `BlockStoreError` (replica_agent.errors), whose `.code()` is the
`grpc.StatusCode` and whose class is also the server's exception class (e.g.
`isinstance(e, PermissionDenied)`), whichever transport answered.
Thread-safe: one client (one HTTP/2 channel) may be shared by threads.

Deadlines. `timeout_s` is each call's whole budget (replica_agent.deadline): OpenBulk,
connecting, the handshake, the request and every byte of the reply, on the bulk channel
(TCP, TLS, sealed, same-host arena) and over gRPC, including a Get stream's last
frame and a fallback from one to the other. A reply that comes too slowly, however
each single receive behaves, ends the call with DEADLINE_EXCEEDED (`timeout_s=None`:
no deadline).

Transports. Payloads move over the server's bulk channel (grpc_calls.py for the rest)
unless `bulk=False`; the choice and the fallback live here and only here:
- a call the bulk channel cannot frame goes over gRPC (the server then answers with
  its own message);
- a connection that fails (refused, reset, closed mid-frame; a kept connection the
  server closed while it was idle is only replaced, bulk.py) sends this call over gRPC
  and keeps the bulk channel off for a backoff that doubles up to a minute, counted in
  `transport_stats.bulk_fallbacks` and logged once per backoff window; then it is tried
  again. When gRPC cannot reach the server either, the channel was not at fault (the
  server is down or restarting): no backoff, so the bulk channel is used again as soon
  as the server is back. The fallback gets what is left of the call's deadline; when
  the bulk channel used it all (a stalled reply), there is no fallback: the call ends
  DEADLINE_EXCEEDED at its deadline, not a second `timeout_s` later, and the backoff
  sends the next calls over gRPC;
- a server without a bulk channel turns it off for good.
Policy errors (the server's statuses) are raised whatever the transport: gRPC would
answer the same.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from kvcommon import bulkwire as w
from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.bulk import BulkChannel, UseGrpc
from replica_agent.deadline import CallDeadline
from replica_agent.errors import BlockStoreError, store_error
from replica_agent.grpc_calls import GrpcCalls, NoBulkListener
from replica_agent.targets import balancing_options, grpc_target

log = logging.getLogger(__name__)

DEFAULT_FRAME_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
LOCAL_RETRY_S = 30.0  # after the same-host listener refused or failed, use TCP this long
Payload = bytes | bytearray | memoryview
View = bytes | memoryview  # a block as read: bytes (gRPC) or a view of a reused buffer

__all__ = ["BlockClient", "BlockStoreError", "ClientTls"]


@dataclass(frozen=True)
class ClientTls:
    """TLS for the client: the server's CA, and a client certificate for mTLS."""

    root_ca: Path | None = None  # None: the system trust store
    client_cert: Path | None = None
    client_key: Path | None = None
    server_name: str | None = None  # override when the address is not in the certificate

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust for the bulk channel as for gRPC."""
        context = ssl.create_default_context(cafile=self.root_ca)
        context.options |= w.SSL_OP_ENABLE_KTLS  # kernel TLS where the kernel has it
        if self.client_cert is not None and self.client_key is not None:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p: Path | None) -> bytes | None:
            return p.read_bytes() if p is not None else None

        return grpc.ssl_channel_credentials(
            read(self.root_ca), read(self.client_key), read(self.client_cert)
        )


@dataclass
class ClientStats:
    bulk_fallbacks: int = 0  # calls sent over gRPC because the bulk channel failed
    same_host_connections: int = 0  # bulk connections that got the same-host arena
    same_host_fallbacks: int = 0  # same-host connections refused or failed: TCP instead


class _Backoff:
    """Off for a while after a failure, doubling while failures repeat."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self._first_s, self._max_s = first_s, max_s
        self._delay_s = 0.0
        self._until = 0.0
        self._lock = threading.Lock()

    def allowed(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self) -> bool:
        """Start (or extend) the off window; True when this opens a new window."""
        with self._lock:
            now = time.monotonic()
            if now < self._until:
                return False
            self._delay_s = min(self._max_s, max(self._first_s, 2 * self._delay_s))
            self._until = now + self._delay_s
            return True

    def succeeded(self) -> None:
        self._delay_s = 0.0

    def forgive(self) -> None:
        """The failure was not the channel's (the whole server was unreachable): no
        window, so the channel is tried first as soon as the server answers again."""
        with self._lock:
            self._delay_s = self._until = 0.0


class BlockClient:
    def __init__(
        self,
        address: str | Sequence[str],
        token: str,
        *,
        tls: ClientTls | None = None,
        timeout_s: float | None = 30.0,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        options: Sequence[tuple[str, Any]] = (),
        bulk: bool = True,
        same_host: bool = True,
        sealed_channel: bool = False,
    ) -> None:
        """`bulk`: move payloads over the server's bulk channel (one-time tickets from
        OpenBulk, same credentials and policy); gRPC otherwise. `same_host`: on the
        server's own host, move them through a shared-memory arena the server hands
        out over a Unix socket (no TCP, no TLS: the bytes never leave the host's
        kernel); off, or elsewhere, over TCP/TLS. `sealed_channel`: this caller opens
        every block it reads under the tenant's key before use (the replica agent with
        a keyring); then, over TLS, a tenant that requires sealed blocks gets the
        sealed-payload channel (replica_agent.bulk_sealed): headers under AEAD, sealed
        payloads not encrypted a second time. `address`: one server, or several that
        share a store (a list, or an `ipv4:`/`dns:` target; replica_agent.targets):
        calls round-robin across them and move off one that goes away."""
        address = grpc_target(address)
        channel_options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # The store sits next to the replicas: after it restarts, reconnect within
            # a second or two instead of gRPC's default backoff of up to two minutes.
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000),
            *balancing_options(address),
            *options,
        ]
        if tls is not None:
            if tls.server_name:
                channel_options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, tls.credentials(), channel_options)
        else:
            self._channel = grpc.insecure_channel(address, channel_options)
        # A wildcard bulk address means the host this client dialed (kvcommon.hostport).
        self._grpc = GrpcCalls(
            self._channel,
            address,
            token,
            timeout_s,
            frame_bytes,
            sealed_channel=sealed_channel and tls is not None,  # its secret crosses TLS only
        )
        # A sealed-channel caller looks up over gRPC: the sealed channel's frames carry
        # blocks, and a second connection just for lookups would buy nothing there.
        self._bulk_lookups = not (sealed_channel and tls is not None)
        self.transport_stats = ClientStats()
        self._bulk_backoff = _Backoff(FIRST_BACKOFF_S, MAX_BACKOFF_S)
        self._local_backoff = _Backoff(LOCAL_RETRY_S, LOCAL_RETRY_S)
        self._bulk: BulkChannel | None = None
        if bulk:
            self._bulk = BulkChannel(
                self._grpc.open_bulk,
                tls.ssl_context() if tls else None,
                tls.server_name if tls else None,
                timeout_s,
                same_host=same_host,
                local_allowed=self._local_backoff.allowed,
                local_failed=self._same_host_failed,
                local_opened=self._same_host_opened,
            )

    @property
    def timeout_s(self) -> float | None:
        return self._grpc.timeout_s

    def __enter__(self) -> BlockClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._bulk is not None:
            self._bulk.close()
        self._channel.close()

    # -- the transport choice -----------------------------------------------------------

    def _same_host_opened(self) -> None:
        self.transport_stats.same_host_connections += 1

    def _same_host_failed(self) -> None:
        self.transport_stats.same_host_fallbacks += 1
        self._local_backoff.failed()

    def _bulk_now(self) -> BulkChannel | None:
        bulk = self._bulk
        return bulk if bulk is not None and self._bulk_backoff.allowed() else None

    def _bulk_failed(self, error: Exception, deadline: CallDeadline) -> None:
        """The bulk path broke below the policy layer: this call goes over gRPC with
        what is left of `deadline`, or ends DEADLINE_EXCEEDED when nothing is."""
        if isinstance(error, UseGrpc):
            return  # this call only; nothing is wrong with the channel
        if isinstance(error, NoBulkListener):
            log.info("the server has no bulk channel; using gRPC")
            self._bulk = None
            return
        if self._bulk_backoff.failed():
            log.warning(
                "bulk channel failed (%s); using gRPC, retrying the bulk channel later",
                type(error).__name__,
            )
        if deadline.is_spent():  # a fallback now would only add to the stall
            raise deadline.exceeded() from None
        self.transport_stats.bulk_fallbacks += 1

    # -- calls ------------------------------------------------------------------------

    def lookup(self, tenant: str, model: str, digests: Sequence[bytes]) -> int:
        """How many leading digests are stored: over the bulk channel when it is up (a
        small call, where gRPC's per-call cost is most of the time), else gRPC."""
        deadline = CallDeadline(self.timeout_s)
        bulk = self._bulk_now() if self._bulk_lookups else None
        if bulk is not None:
            try:
                present = bulk.lookup(tenant, model, digests, deadline=deadline)
            except (OSError, w.ConnectionClosed, NoBulkListener, UseGrpc) as error:
                self._bulk_failed(error, deadline)
            else:
                self._bulk_backoff.succeeded()
                return present
        return self._grpc.lookup(tenant, model, digests, deadline)

    def get(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[bytes]:
        return [bytes(v) for v in self._read(tenant, model, digests, keep=True)]

    def get_views(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[View]:
        """Like `get`, without copies where the bulk channel is used: the views stay
        valid until this thread's next call on this client. Decode them at once."""
        return list(self._read(tenant, model, digests, keep=True))

    def iter_views(self, tenant: str, model: str, digests: Sequence[bytes]) -> Iterator[View]:
        """The leading present payloads one at a time, each valid until the next is
        requested: the restore path's zero-copy iterator."""
        return self._read(tenant, model, digests, keep=False)

    def _read(
        self, tenant: str, model: str, digests: Sequence[bytes], *, keep: bool
    ) -> Iterator[View]:
        """The one read path: the bulk channel, else gRPC (module docstring)."""
        deadline = CallDeadline(self.timeout_s)
        bulk = self._bulk_now()
        if bulk is not None:
            try:
                stream = bulk.read(tenant, model, digests, keep=keep, deadline=deadline)
                first = next(stream, None)  # connection and policy errors surface here
            except (OSError, w.ConnectionClosed, NoBulkListener, UseGrpc) as error:
                self._bulk_failed(error, deadline)
                fallback = self._grpc.iter_get(tenant, model, digests, deadline)
                return self._forgiving(fallback)
            self._bulk_backoff.succeeded()
            return _then(first, stream, deadline)
        return self._grpc.iter_get(tenant, model, digests, deadline)

    def _forgiving(self, fallback: Iterator[View]) -> Iterator[View]:
        """A fallback read: if gRPC cannot reach the server either, the bulk channel was
        not at fault (module docstring)."""
        try:
            yield from fallback
        except BlockStoreError as error:
            if _unreachable(error):
                self._bulk_backoff.forgive()
            raise

    def put(
        self, tenant: str, model: str, digests: Sequence[bytes], payloads: Sequence[Payload]
    ) -> list[bool]:
        """Store blocks; per block True if newly stored, False if it was already present."""
        if len(digests) != len(payloads):
            raise ValueError(
                f"{len(digests)} digests but {len(payloads)} payloads; pass one payload per digest"
            )
        deadline = CallDeadline(self.timeout_s)
        bulk = self._bulk_now()
        if bulk is not None:
            try:
                stored = bulk.put(tenant, model, digests, payloads, deadline)
            except (OSError, w.ConnectionClosed, NoBulkListener, UseGrpc) as error:
                self._bulk_failed(error, deadline)  # puts are idempotent: this one goes
                try:  # over gRPC
                    return self._grpc.put(tenant, model, digests, payloads, deadline)
                except BlockStoreError as fallback_error:
                    if _unreachable(fallback_error):
                        self._bulk_backoff.forgive()
                    raise
            self._bulk_backoff.succeeded()
            return stored
        return self._grpc.put(tenant, model, digests, payloads, deadline)

    def delete(self, tenant: str, model: str, digests: Sequence[bytes]) -> int:
        return self._grpc.delete(pb.DeleteRequest(tenant=tenant, model=model, digests=digests))

    def delete_tenant(self, tenant: str, model: str = "") -> int:
        """Delete every block of `tenant`, or only those of `model` (needs `admin`)."""
        return self._grpc.delete(pb.DeleteRequest(tenant=tenant, model=model, whole_tenant=True))

    def stats(self) -> pb.StatsResponse:
        return self._grpc.stats()


def _unreachable(error: BlockStoreError) -> bool:
    return error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _then(
    first: memoryview | None, rest: Iterator[memoryview], deadline: CallDeadline
) -> Iterator[View]:
    """`first`, then the rest of a bulk read; a connection lost mid-stream is an
    UNAVAILABLE error, a reply too slow for the deadline DEADLINE_EXCEEDED (the caller
    keeps what it already has)."""
    if first is None:
        return
    yield first
    try:
        yield from rest
    except (OSError, w.ConnectionClosed) as error:
        if deadline.is_spent():
            raise deadline.exceeded() from None
        raise store_error("UNAVAILABLE", f"bulk transfer broke: {error}") from None
