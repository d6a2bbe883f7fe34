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
from policy import permissions
from policy.access_change import AccessChange, diff_access
from policy.audit import AuditLog, Field
from policy.config import AccessConfig, PublicConfig, TenantConfig
from policy.identity import (
    Action,
    Authenticator,
    CertCredential,
    Principal,
    TokenCredential,
    certificate_identities,
    describe,
)
from policy.naming import BlockNamer, TenantNamer
from policy.permissions import PublicScope
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
)

AuthContext = Mapping[str, Sequence[bytes]]
# Anyone can fail to authenticate, as fast as the network allows: each failure is
# audited, but at most this often (a burst of this many at once); the next record
# says how many were left out (`suppressed`), so an unauthenticated flood cannot fill
# the audit log's disk, and the log still shows that it happened and how big it was.
AUTHN_FAILURE_RECORDS_PER_S = 10
AUTHN_FAILURE_BURST = 50
REVOKED_MESSAGE = (
    "this credential was revoked by the server's config (reloaded); ask the operator "
    "for a current token or certificate"
)


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
        self._set_tenant_rules(tenants, public)
        # name -> the principal as the config serving now has it; None until the first
        # live reload (until then every principal is as it was authenticated: `current`)
        self._live: dict[str, Principal] | None = None
        self._reload_lock = threading.Lock()
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

    def _set_tenant_rules(
        self, tenants: Sequence[TenantConfig], public: PublicConfig | None
    ) -> None:
        self.has_public = public is not None
        self.public_scope = PublicScope(
            self.has_public, frozenset(t.id for t in tenants if t.read_public)
        )
        sealed_only = {t.id for t in tenants if t.require_sealed}
        if public is not None and public.require_sealed:
            sealed_only.add(PUBLIC)
        self._sealed_only = frozenset(sealed_only)

    # -- live reload ------------------------------------------------------------------

    def reload_access(
        self, access: AccessConfig, *, requests_per_s: int, burst_s: int
    ) -> AccessChange:
        """Serve `access` from now on (a live config reload; its epochs and whether it
        has a public scope are the running ones: cacheserver.reload refuses changes to
        either). Each principal is judged by its new entry on its next request
        (`current`); the returned change says whose open streams and connections the
        server must close."""
        with self._reload_lock:
            old = self._authenticator.principals()
            new = access.principals()
            change = diff_access(
                old,
                new,
                (t for t in self.quotas_bytes if t != PUBLIC),
                (t.id for t in access.tenants),
            )
            # Whatever a request reads next is consistent: the credentials last, so a
            # principal authenticated by them is judged by these rules.
            self._limiter.set_defaults(requests_per_s, burst_s)
            self.quotas_bytes = access.quotas_bytes()
            self._set_tenant_rules(access.tenants, access.public)
            # A principal the reload leaves as it was keeps its object: what it holds
            # open stays current (`is_current`), e.g. a connection a bulk worker may take.
            kept = {p.name: p for p in old}

            def same(principal: Principal) -> Principal:
                before = kept.get(principal.name)
                return before if before == principal else principal

            tokens = [
                TokenCredential(c.token_sha256, same(c.principal)) for c in access.credentials
            ]
            certs = [CertCredential(c.identity, same(c.principal)) for c in access.cert_credentials]
            self._live = {p.name: same(p) for p in new}
            self._authenticator = Authenticator(tokens, certs)
        return change

    def current(self, principal: Principal) -> Principal:
        """`principal` as the config serving now has it: itself until a live reload;
        after one, its name's entry while that keeps the same credential (with the
        tenants, actions and rate it has now), else Unauthenticated: whatever a removed
        principal or a replaced credential opened is refused from then on."""
        live = self._live
        if live is None:
            return principal
        now = live.get(principal.name)
        if now is principal:
            return principal
        if now is None or now.credential != principal.credential:
            raise Unauthenticated(REVOKED_MESSAGE)
        return now

    def is_current(self, principal: Principal) -> bool:
        """Whether `principal` is served as it was authenticated (not revoked, nothing
        taken away since): what a bulk worker may serve on its own."""
        live = self._live
        return live is None or live.get(principal.name) is principal

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
        principal = self.current(principal)
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
        principal = self.current(principal)
        checked = permissions.tenant_id(principal, tenant)
        if not permissions.allows(principal, checked, action, self.public_scope):
            self.audit.record(
                "denied", principal=principal.name, tenant=checked, action=action.value
            )
            raise PermissionDenied(
                f"principal {principal.name!r} may not {action.value} this tenant; "
                "grant it in the server config ([[principals]] tenants/actions)"
            )
        return checked

    def visible_tenants(self, principal: Principal) -> frozenset[TenantId]:
        return self.current(principal).tenants

    def is_admin(self, principal: Principal) -> bool:
        return Action.ADMIN in self.current(principal).actions

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
