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

Transports. The client holds its transports (replica_agent.transport): gRPC
(grpc_calls.py) and, unless `bulk=False`, the server's bulk channel (bulk.py), which
moves payloads. Which transport carries a call, when a call falls back to
gRPC, when the bulk channel is off for a while and when that is forgiven (a server that
gRPC cannot reach either was down or restarting: the channel was not at fault), and
when a call gives up: one rule for every call, in replica_agent.fallback. Fallbacks are
counted in `transport_stats` (`bulk_fallbacks`, `same_host_fallbacks`).
Policy errors (the server's statuses) are raised whatever the transport: gRPC would
answer the same.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from kvcommon import bulkio
from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.bulk import BulkChannel
from replica_agent.deadline import CallDeadline
from replica_agent.errors import BlockStoreError
from replica_agent.fallback import ClientStats, Fallback
from replica_agent.grpc_calls import GrpcCalls
from replica_agent.targets import balancing_options, grpc_target
from replica_agent.transport import Payload, PieceSink, View

DEFAULT_FRAME_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
LOCAL_RETRY_S = 30.0  # after the same-host listener refused or failed, use TCP this long

__all__ = ["BlockClient", "BlockStoreError", "ClientStats", "ClientTls", "Payload", "View"]


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
        context.options |= bulkio.SSL_OP_ENABLE_KTLS  # kernel TLS where the kernel has it
        if self.client_cert is not None and self.client_key is not None:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p: Path | None) -> bytes | None:
            return p.read_bytes() if p is not None else None

        return grpc.ssl_channel_credentials(
            read(self.root_ca), read(self.client_key), read(self.client_cert)
        )


class BlockClient:
    def __init__(
        self,
        address: str | Sequence[str],
        token: str | Callable[[], str],
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
        calls round-robin across them and move off one that goes away. `token`: the
        bearer token, or a `replica_agent.credentials.TokenFile`, whose current token
        each call sends (rotation without a restart)."""
        address = grpc_target(address)
        channel_options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # The store sits next to the replicas: after it restarts, reconnect within
            # a second or two instead of gRPC's default backoff of up to two minutes.
            # Not grpc.min_reconnect_backoff_ms: gRPC takes it as the time a connection
            # attempt may take (20 s by default), and at 250 ms a TLS handshake with a
            # busy server failed, and every call with it (UNAVAILABLE at once).
            ("grpc.initial_reconnect_backoff_ms", 250),
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
        self.transport_stats = ClientStats()
        # Every call goes through one fallback rule (replica_agent.fallback).
        self._transport = Fallback(
            self._grpc,
            self.transport_stats,
            first_backoff_s=FIRST_BACKOFF_S,
            max_backoff_s=MAX_BACKOFF_S,
            same_host_retry_s=LOCAL_RETRY_S,
        )
        self._bulk: BulkChannel | None = None
        if bulk:
            self._bulk = BulkChannel(
                self._grpc.open_bulk,
                tls.ssl_context() if tls else None,
                tls.server_name if tls else None,
                timeout_s,
                same_host=same_host,
                # A sealed-channel caller looks up over gRPC: the sealed channel's frames
                # carry blocks, and a second connection just for lookups would buy nothing.
                lookups=not (sealed_channel and tls is not None),
                local_allowed=self._transport.same_host_allowed,
                local_failed=self._transport.same_host_failed,
                local_opened=self._transport.same_host_opened,
            )
            self._transport.use(self._bulk)

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

    # -- calls ------------------------------------------------------------------------

    def lookup(self, tenant: str, model: str, digests: Sequence[bytes]) -> int:
        """How many leading digests are stored: over the bulk channel when it is up (a
        small call, where gRPC's per-call cost is most of the time), else gRPC."""
        return self._transport.lookup(tenant, model, digests, CallDeadline(self.timeout_s))

    # The three reads are the one read path, Fallback.read (replica_agent.fallback),
    # each called straight from here: a GET's Python calls are much of its cost.

    def get(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[bytes]:
        deadline = CallDeadline(self._grpc.timeout_s)
        views = self._transport.read(tenant, model, digests, keep=True, deadline=deadline)
        return list(map(bytes, views))

    def get_views(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        *,
        pieces: PieceSink | None = None,
    ) -> list[View]:
        """Like `get`, without copies where the bulk channel is used: the views stay
        valid until this thread's next call on this client. Decode them at once.
        `pieces`: each block's bytes are fed there as they arrive, before it is
        returned (open sealed blocks with `BlockSealer.opening` while the rest of the
        reply is on the wire; replica_agent.transport.PieceSink)."""
        deadline = CallDeadline(self._grpc.timeout_s)
        read = self._transport.read
        return list(read(tenant, model, digests, keep=True, deadline=deadline, pieces=pieces))

    def iter_views(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        *,
        pieces: PieceSink | None = None,
    ) -> Iterator[View]:
        """The leading present payloads one at a time, each valid until the next is
        requested: the restore path's zero-copy iterator. `pieces`: as `get_views`."""
        deadline = CallDeadline(self._grpc.timeout_s)
        read = self._transport.read
        return read(tenant, model, digests, keep=False, deadline=deadline, pieces=pieces)

    def put(
        self, tenant: str, model: str, digests: Sequence[bytes], payloads: Sequence[Payload]
    ) -> list[bool]:
        """Store blocks; per block True if newly stored, False if it was already present."""
        if len(digests) != len(payloads):
            raise ValueError(
                f"{len(digests)} digests but {len(payloads)} payloads; pass one payload per digest"
            )
        deadline = CallDeadline(self.timeout_s)
        return self._transport.put(tenant, model, digests, payloads, deadline)

    def delete(self, tenant: str, model: str, digests: Sequence[bytes]) -> int:
        request = pb.DeleteRequest(tenant=tenant, model=model, digests=digests)
        return self._transport.delete(request, CallDeadline(self.timeout_s))

    def delete_tenant(self, tenant: str, model: str = "") -> int:
        """Delete every block of `tenant`, or only those of `model` (needs `admin`)."""
        request = pb.DeleteRequest(tenant=tenant, model=model, whole_tenant=True)
        return self._transport.delete(request, CallDeadline(self.timeout_s))

    def stats(self) -> pb.StatsResponse:
        return self._transport.stats(CallDeadline(self.timeout_s))
