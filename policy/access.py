"""The server's one policy entry point: authenticate, then admit.

Every RPC calls `authenticate` once (the server's wire edge does it before the
handler runs), then `admit` for each tenant and action the request names. Deny by
default: a principal acts only for the tenants and actions its config lists.
Authorization answers PERMISSION_DENIED with one fixed message whether or not the
named tenant exists, so a principal cannot enumerate tenants. Failures, denials,
rate-limit episodes and admin actions go to the audit log from here.

The public scope (`@public`, policy.types.PUBLIC; `[public]` in the config) holds
prefixes published for every tenant, such as an agent framework's instructions:
- write (put, delete by digest): only principals with the `publish` action, which
  need no tenants, so no tenant's replica can poison what the others read;
- read (lookup, get): principals with `publish`, and principals with `read` of any
  tenant with `read_public = true`; everyone else gets the one denial;
- nothing else (namespace deletes, stats) is done to it through a tenant's grants.
Side channel, accepted on purpose: a reader learns by lookup or timing whether a
prefix was published. That is the catalogue every reader holds anyway. What another
tenant read is not observable: reads leave the scope as they found it (the store keeps
it in put order and never promotes it on a read; docs/isolation.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kvcommon.errors import InvalidArgument, PermissionDenied, Unauthenticated
from policy.audit import AuditLog, Field
from policy.config import AccessConfig, PublicConfig, TenantConfig
from policy.identity import (
    Action,
    Authenticator,
    Principal,
    certificate_identities,
    describe,
)
from policy.naming import BlockNamer, TenantNamer
from policy.ratelimit import RateLimited, RequestRateLimiter
from policy.sealing import looks_sealed
from policy.shared_values import ValueMac
from policy.types import (
    PUBLIC,
    BlockDigest,
    ModelName,
    ModelTag,
    StorageKey,
    TenantId,
    parse_tenant_id,
)

AuthContext = Mapping[str, Sequence[bytes]]
# Anyone can fail to authenticate, as fast as the network allows: each failure is
# audited, but at most this often (a burst of this many at once); the next record
# says how many were left out (`suppressed`), so an unauthenticated flood cannot fill
# the audit log's disk, and the log still shows that it happened and how big it was.
AUTHN_FAILURE_RECORDS_PER_S = 10
AUTHN_FAILURE_BURST = 50


class AuditGate:
    """A token bucket for audit records of one kind. Thread-safe."""

    def __init__(
        self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._per_s, self._burst, self._clock = per_s, burst, clock
        self._tokens = float(burst)
        self._at = clock()
        self._suppressed = 0
        self._lock = threading.Lock()

    def admit(self) -> int | None:
        """None: leave this record out. Else write it, noting the number left out
        since the last one written."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._per_s)
            self._at = now
            if self._tokens < 1:
                self._suppressed += 1
                return None
            self._tokens -= 1
            suppressed, self._suppressed = self._suppressed, 0
            return suppressed


class AccessPolicy:
    def __init__(
        self,
        authenticator: Authenticator,
        namer: BlockNamer,
        quotas_bytes: Mapping[TenantId, int],
        *,
        tenants: Sequence[TenantConfig] = (),
        public: PublicConfig | None = None,
        limiter: RequestRateLimiter | None = None,
        audit: AuditLog | None = None,
        accept_certificates: bool = False,
    ) -> None:
        """`accept_certificates`: only when the server verifies client certificates (mTLS)."""
        self._authenticator = authenticator
        self._namer = namer
        self.quotas_bytes = dict(quotas_bytes)
        self.has_public = public is not None
        self._public_readers = frozenset(t.id for t in tenants if t.read_public)
        self._sealed_only = {t.id for t in tenants if t.require_sealed}
        if public is not None and public.require_sealed:
            self._sealed_only.add(PUBLIC)
        self._limiter = limiter or RequestRateLimiter(0)
        self.audit = audit or AuditLog.disabled()
        self._accept_certificates = accept_certificates
        self._authn_failures = AuditGate(AUTHN_FAILURE_RECORDS_PER_S, AUTHN_FAILURE_BURST)

    @classmethod
    def from_access(
        cls,
        access: AccessConfig,
        server_secret: bytes,
        *,
        limiter: RequestRateLimiter | None = None,
        audit: AuditLog | None = None,
        accept_certificates: bool = False,
    ) -> AccessPolicy:
        return cls(
            Authenticator(access.credentials, access.cert_credentials),
            BlockNamer(server_secret, access.epochs()),
            access.quotas_bytes(),
            tenants=access.tenants,
            public=access.public,
            limiter=limiter,
            audit=audit,
            accept_certificates=accept_certificates,
        )

    # -- authentication ---------------------------------------------------------------

    @property
    def reads_certificates(self) -> bool:
        """Whether `authenticate` uses the auth context (the server verifies client certs)."""
        return self._accept_certificates

    def authenticate(
        self, authorization: str | None, auth_context: AuthContext | None = None
    ) -> Principal:
        """The calling principal, or Unauthenticated. (Its request rate is counted by
        `check_rate`, once per request, where the request core admits the request.)

        `auth_context` is the call's gRPC auth context (peer certificate properties);
        it is read only when the server verifies client certificates.
        """
        identities = (
            certificate_identities(auth_context)
            if self._accept_certificates and auth_context
            else frozenset()
        )
        try:
            principal = self._authenticator.authenticate(authorization, identities)
        except Unauthenticated:
            suppressed = self._authn_failures.admit()
            if suppressed is not None:
                presented = describe(authorization, identities)
                self.audit.record(
                    "authn_failure",
                    credential=presented.kind,
                    cert_identities=sorted(presented.cert_identities) or None,
                    suppressed=suppressed or None,
                )
            raise
        return principal

    def check_rate(self, principal: Principal) -> None:
        """Count one request against the principal's rate; ResourceExhausted past it.

        The request core calls it first for every request on every transport (a bulk
        connection authenticates once, with a ticket, and makes many requests)."""
        try:
            self._limiter.admit(principal)
        except RateLimited as limited:
            if limited.first_in_episode:
                self.audit.record(
                    "rate_limited",
                    principal=principal.name,
                    requests_per_s=self._limiter.rate_of(principal),
                )
            raise

    # -- authorization ----------------------------------------------------------------

    def admit(self, principal: Principal, tenant: str, action: Action) -> TenantId:
        """The checked tenant id, or PermissionDenied. Validates the id's shape first
        (a tenant of the principal's own was validated when the config was read)."""
        tenant_id = TenantId(tenant) if tenant in principal.tenants else parse_tenant_id(tenant)
        if not self._allows(principal, tenant_id, action):
            self.audit.record(
                "denied", principal=principal.name, tenant=tenant_id, action=action.value
            )
            raise PermissionDenied(
                f"principal {principal.name!r} may not {action.value} this tenant; "
                "grant it in the server config ([[principals]] tenants/actions)"
            )
        return tenant_id

    def _allows(self, principal: Principal, tenant: TenantId, action: Action) -> bool:
        if tenant == PUBLIC:
            return self.has_public and self._allows_public(principal, action)
        return tenant in principal.tenants and action in principal.actions

    def _allows_public(self, principal: Principal, action: Action) -> bool:
        publisher = Action.PUBLISH in principal.actions
        if action is Action.READ:
            return publisher or (
                Action.READ in principal.actions
                and not principal.tenants.isdisjoint(self._public_readers)
            )
        return publisher and action is Action.WRITE

    def visible_tenants(self, principal: Principal) -> frozenset[TenantId]:
        return principal.tenants

    def is_admin(self, principal: Principal) -> bool:
        return Action.ADMIN in principal.actions

    def requires_sealed(self, tenant: TenantId) -> bool:
        """Whether `tenant` accepts only sealed blocks (`require_sealed`)."""
        return tenant in self._sealed_only

    # -- names and audit ----------------------------------------------------------------

    def epoch(self, tenant: TenantId) -> int:
        return self._namer.epoch(tenant)

    def check_payload(
        self, tenant: TenantId, payload: bytes | bytearray | memoryview, index: int
    ) -> None:
        """For a tenant with `require_sealed`, refuse a payload that is not a sealed block.

        Only the sealed format's fixed header and minimum length are checked: the server
        holds no data key and cannot open anything; a forged header still fails to open
        on every agent.
        """
        if tenant in self._sealed_only and not looks_sealed(payload):
            raise InvalidArgument(
                f"block {index} is not sealed, and this tenant requires sealed blocks; give "
                "the agent its keyring (policy.sealing.BlockSealer)"
            )

    def model_tag(self, tenant: TenantId, model: ModelName) -> ModelTag:
        return self._namer.model_tag(tenant, model)

    def storage_key(self, tenant: TenantId, model: ModelName, digest: BlockDigest) -> StorageKey:
        return self._namer.storage_key(tenant, model, digest)

    def storage_keys(
        self, tenant: TenantId, model: ModelName, digests: Sequence[BlockDigest]
    ) -> list[StorageKey]:
        return self._namer.storage_keys(tenant, model, digests)

    def tenant_namer(self, tenant: TenantId) -> TenantNamer:
        """One tenant's block names alone (policy.naming.BlockNamer.tenant_namer)."""
        return self._namer.tenant_namer(tenant)

    def cluster_tag(self, tenant: TenantId) -> bytes:
        """The tenant's keyed name in a shared tier (policy.naming.BlockNamer.cluster_tag)."""
        return self._namer.cluster_tag(tenant)

    def shared_value_mac(self) -> ValueMac:
        """What a shared tier tags and checks its values with (policy.shared_values)."""
        return self._namer.shared_value_mac()

    def record_admin(self, principal: Principal | None, action: str, **fields: Field) -> None:
        """An admin action (whole-tenant delete, reclamation at start-up, ...)."""
        self.audit.record(
            "admin", principal=principal.name if principal else None, action=action, **fields
        )

    def record_integrity_failure(self, tenant: TenantId, blocks: int) -> None:
        self.audit.record("integrity_failure", tenant=tenant, blocks=blocks, tier="lmdb")
