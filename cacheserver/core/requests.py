"""The request core: every verb admitted and carried out once, for every transport.

The gRPC service (`cacheserver.transport.grpc.service`), the bulk channel over TCP, TLS
and the sealed-payload channel, and the same-host arena
(`cacheserver.transport.bulk`) only frame: each decodes a request into a verb's
arguments, calls the verb, and encodes its result, or its `KvshareError` (whose class
names the status every wire format carries: kvcommon.errors). So the same call gets
the same answer on every transport (tests/e2e/test_transport_parity.py).

A verb that names a tenant's blocks starts with `begin` (admission's first stage, from
what a request's header says; cacheserver.core.admission has the whole order) and
takes its `Begun` value:

    begin(principal, verb, tenant, count) -> Begun
    lookup(begun, model, digests)         -> leading present blocks
    get(begun, model, digests, ...)       -> GetReply: Served batches to encode
    put(begun, model)                     -> PutStream: announce, then store, each block
    put_blocks(begun, model, digests, sizes, sources) -> outcomes (a whole put at once)
    delete(begun, model, digests)         -> blocks deleted
    delete_namespace(begun, model)        -> blocks deleted
    stats(principal)                      -> StatsView
    open_bulk(principal, tenant, ...)     -> BulkOffer
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

from cacheserver.blocks import BlockSource
from cacheserver.config import LimitsConfig
from cacheserver.core.admission import Admission
from cacheserver.core.transfers import GetReply, PutStream
from cacheserver.core.values import (
    DISK_BATCH_BYTES,
    Accept,
    Begun,
    BulkEndpoint,
    BulkOffer,
    StatsView,
    TenantView,
    Verb,
)
from cacheserver.events import TenantCounters
from cacheserver.store import BlockStore
from kvcommon.errors import Unavailable
from policy import AccessPolicy, Principal
from policy.bulkchannel import new_channel_secret
from policy.tickets import local_binding
from policy.types import parse_model

# A put's sources, made once all its blocks are admitted (a transport reads no payload
# before then): one per block size, in request order.
Sources = Callable[[Sequence[int]], Sequence[BlockSource]]


class RequestCore:
    def __init__(
        self,
        store: BlockStore,
        policy: AccessPolicy,
        limits: LimitsConfig,
        counters: TenantCounters,
        *,
        receive_bytes: int,
        bulk: BulkEndpoint | None = None,
    ) -> None:
        """`receive_bytes`: the receive budget (cacheserver.core.admission.Admission)."""
        self._store = store
        self._policy = policy
        self._counters = counters
        self._admission = Admission(policy, limits, store.check_room, receive_bytes)
        self.bulk = bulk

    @property
    def limits(self) -> LimitsConfig:
        """`[limits]` as the config serving now has them."""
        return self._admission.limits.current

    def set_limits(self, limits: LimitsConfig) -> None:
        """New `[limits]` (a live reload): every transport's next request is checked
        against them (the gRPC service sizes Get frames by them too)."""
        self._admission.limits.current = limits

    @property
    def lookup_blocks(self) -> bool:
        """Whether `lookup` may block (it asks a shared tier on an index miss): then a
        transport on an event loop calls it from a thread."""
        return self._store.lookup_blocks

    def read_handed_back(self) -> None:
        """A bulk worker handed a read back to the server (blocks LMDB lacks, or a read
        it does not serve): the store moves journaled puts there sooner for a while."""
        self._store.reads_handed_back()

    def begin(
        self, principal: Principal, verb: Verb, tenant: str, count: int, *, rate_drawn: bool = False
    ) -> Begun:
        """Admission's first stage: rate, tenant and action, digest count (`count`: the
        digests the request carries; 0 for a put whose blocks arrive one by one).
        `rate_drawn`: a bulk worker drew the request's rate before handing it back."""
        return self._admission.begin(principal, verb, tenant, count, rate_drawn=rate_drawn)

    def lookup(self, begun: Begun, model: str, digests: Sequence[bytes]) -> int:
        """How many leading blocks are present."""
        assert begun.verb is Verb.LOOKUP
        admitted = self._admission.name(begun, model, digests)
        return self._store.lookup(admitted.tenant, admitted.keys)

    def get(
        self,
        begun: Begun,
        model: str,
        digests: Sequence[bytes],
        *,
        batch_bytes: int = DISK_BATCH_BYTES,
        accept: Accept | None = None,
    ) -> GetReply:
        """The leading present blocks, as batches of about `batch_bytes` (a batch from
        memory may hold more). `accept`: what the transport can carry (GetReply)."""
        assert begun.verb is Verb.GET
        admitted = self._admission.name(begun, model, digests)
        return GetReply(self._store, admitted, batch_bytes, accept)

    def put(self, begun: Begun, model: str) -> PutStream:
        """A put's blocks, announced and stored one by one (PutStream)."""
        assert begun.verb is Verb.PUT
        namespace = self._admission.namespace(begun, model)
        return PutStream(self._store, self._policy, self._admission, namespace)

    def put_blocks(
        self,
        begun: Begun,
        model: str,
        digests: Sequence[bytes],
        sizes: Sequence[int],
        sources: Sources,
    ) -> list[bool]:
        """A put whose digests and sizes are all known before its payloads: every block
        is admitted before any payload is taken. Per block: stored (True) or already
        present (False); the first refusal raises. Blocking."""
        with self.put(begun, model) as stream:
            blocks = [
                stream.announce(digest, size) for digest, size in zip(digests, sizes, strict=True)
            ]
            futures: list[concurrent.futures.Future[bool]] = [
                stream.store(block, source)
                for block, source in zip(blocks, sources(sizes), strict=True)
            ]
        return [future.result() for future in futures]

    def delete(self, begun: Begun, model: str, digests: Sequence[bytes]) -> int:
        """Delete blocks by digest. Blocking."""
        assert begun.verb is Verb.DELETE
        admitted = self._admission.name(begun, model, digests)
        return self._store.delete(admitted.keys)

    def delete_namespace(self, begun: Begun, model: str) -> int:
        """Every block of the tenant, or (`model` not empty) of that model, recorded in
        the audit log. Blocking."""
        assert begun.verb is Verb.DELETE_NAMESPACE
        tenant = begun.tenant
        tag = self._policy.model_tag(tenant, parse_model(model)) if model else None
        deleted = self._store.delete_tenant(tenant, tag)
        action = "delete_model_namespace" if model else "delete_tenant"
        self._policy.record_admin(begun.principal, action, tenant=tenant, blocks=deleted)
        return deleted

    def stats(self, principal: Principal) -> StatsView:
        """Usage of the tenants `principal` sees; tiers and integrity for admins."""
        self._admission.count_request(principal)
        tenants = []
        for tenant in sorted(self._policy.visible_tenants(principal)):
            blocks, nbytes = self._store.tenant_usage(tenant)
            quota = self._policy.quotas_bytes.get(tenant, 0)
            tenants.append(TenantView(tenant, blocks, nbytes, quota, self._counters.of(tenant)))
        if not self._policy.is_admin(principal):
            return StatsView(tenants, {}, 0)
        return StatsView(tenants, self._store.tier_usage(), self._store.integrity_failures)

    def open_bulk(
        self,
        principal: Principal,
        tenant: str,
        *,
        sealed_channel: bool = False,
        peer_certificate: bytes = b"",
    ) -> BulkOffer:
        """A one-time ticket for the bulk listener, bound to `principal` and `tenant`.
        `sealed_channel`: the caller asked for the sealed-payload channel over TLS
        (the transport checked both); granted only for a tenant with `require_sealed`.
        `peer_certificate`: the caller's verified client certificate (its SHA-256,
        under mutual TLS): only a TLS connection with that certificate redeems the ticket."""
        self._admission.count_request(principal)
        if self.bulk is None:
            raise Unavailable("this server has no bulk listener; use Get and Put")
        tenant_id = self._admission.open_bulk(principal, tenant)
        secret = b""
        if sealed_channel and self._policy.requires_sealed(tenant_id):
            secret = new_channel_secret()
        ticket = self.bulk.tickets.issue(
            principal, tenant_id, channel_secret=secret, peer_certificate=peer_certificate
        )
        binding = ""
        if self.bulk.local_address and self.bulk.local_namespace:
            binding = local_binding(ticket, self.bulk.local_namespace, self.bulk.local_uid)
        return BulkOffer(ticket, self.bulk, binding, secret)
