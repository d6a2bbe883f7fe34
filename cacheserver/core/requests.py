"""The request core: every operation admitted, named and carried out once, for every transport.

The gRPC service (`cacheserver.transport.grpc.service`) and the bulk listener
(`cacheserver.transport.bulk`) only frame: they parse their wire format into the
arguments below, call one method, and write back its result, or its `KvshareError`
(whose class names the status both wire formats carry). So the same bad call gets the
same status over gRPC, bulk TCP and the same-host arena (tests/e2e/test_transport_parity.py).

Admission, in this order, for every operation that names blocks:

    1. the caller's request rate   RESOURCE_EXHAUSTED  (policy.check_rate: gRPC counts
                                   it when the call is authenticated, the bulk listener
                                   per request on its authenticated connection)
    2. the tenant and the action   PERMISSION_DENIED (INVALID_ARGUMENT: malformed id)
    3. the number of digests       INVALID_ARGUMENT  (before the bulk listener reads them)
    4. the model name              INVALID_ARGUMENT
    5. each digest (32 bytes)      INVALID_ARGUMENT
    6. puts: each block's size     INVALID_ARGUMENT
    then the operation; a put's bytes are checked (require_sealed) once complete.

Client digests become keyed storage names here (`AccessPolicy.storage_key`) before
anything else sees them; from here on only `StorageKey`s travel.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass

from cacheserver.blocks import BlockSource, CheckedSource
from cacheserver.config import LimitsConfig
from cacheserver.events import TenantCounters, TenantCounts
from cacheserver.store import BlockStore
from cacheserver.store.reading import Reading
from kvcommon.errors import InvalidArgument, Unavailable
from policy import AccessPolicy, Action, Principal
from policy.bulkchannel import new_channel_secret
from policy.tickets import TicketBook, local_binding
from policy.types import (
    ModelName,
    ModelTag,
    StorageKey,
    TenantId,
    parse_digest,
    parse_model,
)

# A GET reads at most this much from the disk tier per batch: large enough that one
# read transaction serves a long prefix, small enough to start sending early.
DISK_BATCH_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed admission: its checked tenant, model and storage keys."""

    principal: Principal
    tenant: TenantId
    model: ModelName
    keys: Sequence[StorageKey]


@dataclass(frozen=True, slots=True)
class AdmittedPut:
    """A put's namespace, admitted once; blocks are named one by one as they come."""

    principal: Principal
    tenant: TenantId
    model: ModelName
    tag: ModelTag


@dataclass(frozen=True, slots=True)
class BulkEndpoint:
    """Where OpenBulk sends callers, and the ticket book that admits them there."""

    tickets: TicketBook
    address: str
    local_address: str = ""  # the same-host listener's abstract socket name; "": none
    local_namespace: str = ""  # where that name is the server's (bulkwire.host_namespace)
    local_uid: int = -1  # the uid the server runs as, for the client's peer check


@dataclass(frozen=True, slots=True)
class BulkOffer:
    ticket: bytes
    endpoint: BulkEndpoint
    local_binding: str  # policy.tickets.local_binding: where the same-host listener counts
    channel_secret: bytes = b""  # the sealed-payload channel's secret; b"": not granted


@dataclass(frozen=True, slots=True)
class TenantView:
    tenant: TenantId
    blocks: int
    bytes: int
    quota_bytes: int
    counts: TenantCounts


@dataclass(frozen=True, slots=True)
class StatsView:
    tenants: Sequence[TenantView]
    tiers: dict[str, tuple[int, int, int]]  # admins only: name -> (blocks, bytes, budget)
    integrity_failures: int


class RequestCore:
    def __init__(
        self,
        store: BlockStore,
        policy: AccessPolicy,
        limits: LimitsConfig,
        counters: TenantCounters,
        bulk: BulkEndpoint | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.limits = limits
        self._counters = counters
        self.bulk = bulk

    # -- admission -----------------------------------------------------------------

    def check_rate(self, principal: Principal) -> None:
        """Step 1 for a request on an already authenticated bulk connection."""
        self.policy.check_rate(principal)

    def admit(
        self,
        principal: Principal,
        action: Action,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
    ) -> Admitted:
        """Steps 2-5 of the module docstring, then the storage keys."""
        tenant_id = self.admit_tenant(principal, tenant, action)
        self.limits.check_digest_count(len(digests))
        return self.name(principal, tenant_id, model, digests)

    def name(
        self, principal: Principal, tenant: TenantId, model: str, digests: Sequence[bytes]
    ) -> Admitted:
        """Steps 4-5 for a tenant admitted, and a digest count checked, already (the
        bulk listener does those from a request's header, before reading its body)."""
        model_name = parse_model(model)
        keys = [
            self.policy.storage_key(tenant, model_name, parse_digest(digest, index))
            for index, digest in enumerate(digests)
        ]
        return Admitted(principal, tenant, model_name, keys)

    def admit_tenant(self, principal: Principal, tenant: str, action: Action) -> TenantId:
        """Step 2 alone."""
        return self.policy.admit(principal, tenant, action)

    def admit_put(self, principal: Principal, tenant: str, model: str) -> AdmittedPut:
        tenant_id = self.policy.admit(principal, tenant, Action.WRITE)
        model_name = parse_model(model)
        return AdmittedPut(
            principal, tenant_id, model_name, self.policy.model_tag(tenant_id, model_name)
        )

    def name_block(self, put: AdmittedPut, index: int, digest: bytes, size: int) -> StorageKey:
        """Steps 3, 5 and 6 for block `index` of a put (blocks may arrive one by one)."""
        self.limits.check_digest_count(index + 1)
        key = self.policy.storage_key(put.tenant, put.model, parse_digest(digest, index))
        self.limits.check_block_bytes(index, size)
        self.store.check_room(put.tenant, key, size)  # before any of its bytes are taken
        return key

    # -- operations ----------------------------------------------------------------

    def lookup(self, request: Admitted) -> int:
        return self.store.lookup(request.tenant, request.keys)

    def read(self, request: Admitted) -> Reading:
        """The leading present blocks, batch by batch: `with core.read(r) as reading`."""
        return self.store.read(request.tenant, request.keys)

    def put(
        self, put: AdmittedPut, index: int, key: StorageKey, source: BlockSource
    ) -> concurrent.futures.Future[bool]:
        """Store block `index` of `put` (named by `name_block`). Refusals raise; the
        future says stored (True) or already present (False) once the block is
        acknowledged (see BlockStore.put)."""

        def check(payload: bytes | bytearray | memoryview) -> None:
            self.policy.check_payload(put.tenant, payload, index)

        return self.store.put(put.tenant, key, put.tag, CheckedSource(source, check))

    def delete(self, request: Admitted) -> int:
        """Delete blocks by digest (needs `write`, like a put). Blocking."""
        return self.store.delete(request.keys)

    def delete_namespace(self, principal: Principal, tenant: str, model: str) -> int:
        """Every block of `tenant`, or (`model` not empty) of that model (needs `admin`),
        recorded in the audit log. Blocking."""
        tenant_id = self.policy.admit(principal, tenant, Action.ADMIN)
        tag = self.policy.model_tag(tenant_id, parse_model(model)) if model else None
        deleted = self.store.delete_tenant(tenant_id, tag)
        action = "delete_model_namespace" if model else "delete_tenant"
        self.policy.record_admin(principal, action, tenant=tenant_id, blocks=deleted)
        return deleted

    def stats(self, principal: Principal) -> StatsView:
        tenants = []
        for tenant in sorted(self.policy.visible_tenants(principal)):
            blocks, nbytes = self.store.tenant_usage(tenant)
            quota = self.policy.quotas_bytes.get(tenant, 0)
            tenants.append(TenantView(tenant, blocks, nbytes, quota, self._counters.of(tenant)))
        if not self.policy.is_admin(principal):
            return StatsView(tenants, {}, 0)
        return StatsView(tenants, self.store.tier_usage(), self.store.integrity_failures)

    def open_bulk(
        self,
        principal: Principal,
        tenant: str,
        *,
        sealed_channel: bool = False,
        peer_certificate: bytes = b"",
    ) -> BulkOffer:
        """A one-time ticket for the bulk listener, bound to `principal` and `tenant`.
        Either action opens the connection; each request on it is admitted again.
        `sealed_channel`: the caller asked for the sealed-payload channel over TLS
        (the transport checked both); granted only for a tenant with `require_sealed`.
        `peer_certificate`: the caller's verified client certificate (its SHA-256,
        under mutual TLS): only a TLS connection with that certificate redeems the ticket."""
        if self.bulk is None:
            raise Unavailable("this server has no bulk listener; use Get and Put")
        action = Action.READ if Action.READ in principal.actions else Action.WRITE
        tenant_id = self.policy.admit(principal, tenant, action)
        secret = b""
        if sealed_channel and self.policy.requires_sealed(tenant_id):
            secret = new_channel_secret()
        ticket = self.bulk.tickets.issue(
            principal, tenant_id, channel_secret=secret, peer_certificate=peer_certificate
        )
        binding = ""
        if self.bulk.local_address and self.bulk.local_namespace:
            binding = local_binding(ticket, self.bulk.local_namespace, self.bulk.local_uid)
        return BulkOffer(ticket, self.bulk, binding, secret)


def parse_model_bytes(raw: bytes | memoryview) -> str:
    """A model name as the bulk channel carries it: strict UTF-8, so two different byte
    strings can never name one model."""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument("model is not valid UTF-8; send the model name in UTF-8") from None
