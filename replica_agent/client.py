"""`BlockClient`: the Python client of the kvshare block store (DESIGN §9 names).

    c = BlockClient("127.0.0.1:50051", token="...")   # tls=ClientTls(...) for TLS/mTLS
    c.put(tenant, model, digests, payloads)           # -> list[bool]: True = newly stored
    c.lookup(tenant, model, digests) -> int           # leading digests present
    c.get(tenant, model, digests) -> list[bytes]      # leading present payloads
    c.close()

Misses are results: `lookup` counts, `get` returns the leading blocks that exist.
Errors raise `BlockStoreError`, whose `.code()` is the `grpc.StatusCode` and whose
subclass mirrors the server's exception (e.g. `isinstance(e, PermissionDenied)`).
Thread-safe: one client (one HTTP/2 channel) may be shared by threads.

Each call carries the caller's current trace context (W3C `traceparent`, and its
binary form on the bulk channel: kvcommon.tracing), so the server's span of the call
joins the caller's trace.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from kvcommon import errors
from kvcommon.hostport import bulk_dial_address
from kvcommon.tracing import outgoing_metadata
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from replica_agent.bulk import BulkChannel, Ticket, UseGrpc

log = logging.getLogger(__name__)

DEFAULT_FRAME_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20


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
        if self.client_cert is not None and self.client_key is not None:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p: Path | None) -> bytes | None:
            return p.read_bytes() if p is not None else None

        return grpc.ssl_channel_credentials(
            read(self.root_ca), read(self.client_key), read(self.client_cert)
        )


class _NoBulk(Exception):
    """The server offers no bulk channel."""


class BlockStoreError(errors.KvshareError):
    """A failed RPC. `.code()` is the gRPC status; `.details()` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_SUBCLASSES: dict[grpc.StatusCode, type[BlockStoreError]] = {}


def _error_class(code: grpc.StatusCode) -> type[BlockStoreError]:
    """A subclass of both BlockStoreError and the matching kvshare error, made once."""
    cls = _SUBCLASSES.get(code)
    if cls is None:
        base = next(
            (c for c in errors.KvshareError.__subclasses__() if c.status == code.name), None
        )
        bases: tuple[type, ...] = (BlockStoreError, base) if base else (BlockStoreError,)
        cls = type(f"BlockStore{code.name.title().replace('_', '')}", bases, {})
        _SUBCLASSES[code] = cls
    return cls


def _status_error(status_name: str, message: str) -> BlockStoreError:
    code = getattr(grpc.StatusCode, status_name, grpc.StatusCode.INTERNAL)
    return _error_class(code)(code, message)


def _raise(error: grpc.RpcError) -> BlockStoreError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return _error_class(code)(code, details or "")


class BlockClient:
    def __init__(
        self,
        address: str,
        token: str,
        *,
        tls: ClientTls | None = None,
        timeout_s: float | None = 30.0,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        options: Sequence[tuple[str, Any]] = (),
        bulk: bool = True,
        same_host: bool = True,
    ) -> None:
        """`bulk`: move payloads over the server's bulk channel (one-time tickets from
        OpenBulk, same credentials and policy); plain gRPC when the server has none or
        the channel fails. `same_host`: on the server's own host, move them through a
        shared-memory arena the server hands out over a Unix socket (no TCP, no TLS:
        the bytes never leave the host's kernel); off, or elsewhere, over TCP/TLS."""
        channel_options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # The store sits next to the replicas: after it restarts, reconnect within
            # a second or two instead of gRPC's default backoff of up to two minutes.
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000),
            *options,
        ]
        if tls is not None:
            if tls.server_name:
                channel_options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, tls.credentials(), channel_options)
        else:
            self._channel = grpc.insecure_channel(address, channel_options)
        self._stub = pb_grpc.BlockStoreStub(self._channel)
        self._target = address  # a wildcard bulk address means this host (kvcommon.hostport)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self.timeout_s = timeout_s
        self.frame_bytes = frame_bytes
        self._bulk: BulkChannel | None = None
        if bulk:
            self._bulk = BulkChannel(
                self._open_bulk,
                _status_error,
                tls.ssl_context() if tls else None,
                tls.server_name if tls else None,
                timeout_s,
                same_host=same_host,
            )

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

    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata + outgoing_metadata()

    def _open_bulk(self, tenant: str) -> Ticket:
        try:
            response = self._stub.OpenBulk(
                pb.OpenBulkRequest(tenant=tenant),
                timeout=self.timeout_s,
                metadata=self._call_metadata(),
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise _NoBulk("server predates the bulk channel") from None
            raise _raise(error) from None
        return Ticket(
            response.ticket,
            bulk_dial_address(response.address, self._target),
            response.trace_context,
            response.local_address,
            response.local_namespace,
            response.local_owner,
        )

    def _bulk_failed(self, error: Exception) -> None:
        """The bulk path broke below the policy layer (a reset connection, an old server):
        this call goes over gRPC; an old server turns the bulk path off for good."""
        if not isinstance(error, UseGrpc):
            log.warning("bulk channel failed (%s); this call uses gRPC", type(error).__name__)
        if isinstance(error, _NoBulk) and self._bulk is not None:
            self._bulk.close()
            self._bulk = None

    def lookup(self, tenant: str, model: str, digests: Sequence[bytes]) -> int:
        request = pb.LookupRequest(tenant=tenant, model=model, digests=digests)
        try:
            response = self._stub.Lookup(
                request, timeout=self.timeout_s, metadata=self._call_metadata()
            )
        except grpc.RpcError as error:
            raise _raise(error) from None
        return int(response.present)

    def get(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[bytes]:
        views = self.get_views(tenant, model, digests)
        return [v if isinstance(v, bytes) else bytes(v) for v in views]

    def get_views(
        self, tenant: str, model: str, digests: Sequence[bytes]
    ) -> Sequence[bytes | memoryview]:
        """Like `get`, without copies where the bulk channel is used: the views stay
        valid until this thread's next call on this client. Decode them at once."""
        bulk = self._bulk
        if bulk is not None:
            try:
                return bulk.get_views(tenant, model, digests)
            except (OSError, _NoBulk, UseGrpc) as error:
                self._bulk_failed(error)
        return list(self.iter_get(tenant, model, digests))

    def iter_views(
        self, tenant: str, model: str, digests: Sequence[bytes]
    ) -> Iterator[bytes | memoryview]:
        """The leading present payloads one at a time, each valid until the next is
        requested: the restore path's zero-copy iterator (bulk channel, else gRPC)."""
        bulk = self._bulk
        if bulk is not None:
            try:
                stream = bulk.iter_views(tenant, model, digests)
                first = next(stream, None)  # connection and policy errors surface here
            except (OSError, _NoBulk, UseGrpc) as error:
                self._bulk_failed(error)
            else:
                if first is not None:
                    yield first
                    try:
                        yield from stream
                    except OSError as error:  # mid-stream: the caller keeps what it has
                        raise _status_error(
                            "UNAVAILABLE", f"bulk transfer broke: {error}"
                        ) from None
                return
        yield from self.iter_get(tenant, model, digests)

    def iter_get(self, tenant: str, model: str, digests: Sequence[bytes]) -> Iterator[bytes]:
        """The leading present payloads, each yielded as soon as its last byte arrives,
        so a caller can copy block i to the device while block i+1 is on the wire."""
        request = pb.GetRequest(
            tenant=tenant, model=model, digests=digests, max_frame_bytes=self.frame_bytes
        )
        call = self._stub.Get(request, timeout=self.timeout_s, metadata=self._call_metadata())
        assembled = 0
        partial: bytearray | None = None
        try:
            for frame in call:
                for chunk in frame.chunks:
                    if chunk.index != assembled:
                        raise BlockStoreError(
                            grpc.StatusCode.DATA_LOSS, "server sent blocks out of order"
                        )
                    if chunk.offset == 0 and len(chunk.data) == chunk.block_bytes:
                        assembled += 1
                        yield chunk.data  # a whole block in one chunk: no copy
                        continue
                    if chunk.offset == 0:
                        partial = bytearray(chunk.block_bytes)
                    if partial is None:
                        raise BlockStoreError(
                            grpc.StatusCode.DATA_LOSS, "server sent a chunk without its start"
                        )
                    partial[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
                    if chunk.offset + len(chunk.data) == chunk.block_bytes:
                        assembled += 1
                        yield bytes(partial)
                        partial = None
        except grpc.RpcError as error:
            raise _raise(error) from None
        finally:
            call.cancel()  # a consumer that stops early frees the stream at once

    def put(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        payloads: Sequence[bytes | bytearray | memoryview],
    ) -> list[bool]:
        """Store blocks; per block True if newly stored, False if it was already present."""
        if len(digests) != len(payloads):
            raise ValueError(
                f"{len(digests)} digests but {len(payloads)} payloads; pass one payload per digest"
            )
        bulk = self._bulk
        if bulk is not None:
            try:
                return bulk.put(tenant, model, digests, payloads)
            except (OSError, _NoBulk, UseGrpc) as error:
                self._bulk_failed(error)  # puts are idempotent: retry over gRPC
        frames = _put_frames(tenant, model, digests, payloads, self.frame_bytes)
        try:
            response = self._stub.Put(
                frames, timeout=self.timeout_s, metadata=self._call_metadata()
            )
        except grpc.RpcError as error:
            raise _raise(error) from None
        stored = [False] * len(digests)
        for result in response.results:
            stored[result.index] = result.outcome == pb.PUT_OUTCOME_STORED
        return stored

    def delete(self, tenant: str, model: str, digests: Sequence[bytes]) -> int:
        return self._delete(pb.DeleteRequest(tenant=tenant, model=model, digests=digests))

    def delete_tenant(self, tenant: str, model: str = "") -> int:
        """Delete every block of `tenant`, or only those of `model` (needs `admin`)."""
        return self._delete(pb.DeleteRequest(tenant=tenant, model=model, whole_tenant=True))

    def _delete(self, request: pb.DeleteRequest) -> int:
        try:
            response = self._stub.Delete(
                request, timeout=self.timeout_s, metadata=self._call_metadata()
            )
        except grpc.RpcError as error:
            raise _raise(error) from None
        return int(response.deleted)

    def stats(self) -> pb.StatsResponse:
        try:
            return self._stub.Stats(
                pb.StatsRequest(), timeout=self.timeout_s, metadata=self._call_metadata()
            )
        except grpc.RpcError as error:
            raise _raise(error) from None


def _put_frames(
    tenant: str,
    model: str,
    digests: Sequence[bytes],
    payloads: Sequence[bytes | bytearray | memoryview],
    frame_bytes: int,
) -> Iterator[pb.PutFrame]:
    frame = pb.PutFrame(header=pb.PutHeader(tenant=tenant, model=model))
    filled = 0
    for digest, payload in zip(digests, payloads, strict=True):
        view = memoryview(payload).cast("B")
        offset = 0
        while True:
            take = min(len(view) - offset, frame_bytes - filled)
            data = (
                payload
                if take == len(view) and isinstance(payload, bytes)
                else bytes(view[offset : offset + take])
            )
            frame.chunks.add(
                digest=digest if offset == 0 else b"",
                block_bytes=len(view),
                offset=offset,
                data=data,
            )
            offset += take
            filled += take
            if filled >= frame_bytes:
                yield frame
                frame, filled = pb.PutFrame(), 0
            if offset >= len(view):
                break
    if frame.chunks or frame.HasField("header"):
        yield frame
