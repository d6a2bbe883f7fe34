"""The server's one policy entry point: authenticate, then admit.

Authorization answers PERMISSION_DENIED with one fixed message whether or not the
named tenant exists, so a principal cannot enumerate tenants. Deny by default: a
principal acts only for the tenants and actions its config lists.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvshare.errors import PermissionDenied
from policy.identity import Action, Principal, TokenAuthenticator
from policy.naming import BlockNamer
from policy.types import BlockDigest, ModelName, StorageKey, TenantId, parse_tenant_id


class AccessPolicy:
    def __init__(
        self,
        authenticator: TokenAuthenticator,
        namer: BlockNamer,
        quotas_bytes: Mapping[TenantId, int],
    ) -> None:
        self._authenticator = authenticator
        self._namer = namer
        self.quotas_bytes = dict(quotas_bytes)

    def authenticate(self, authorization: str | None) -> Principal:
        return self._authenticator.authenticate(authorization)

    def admit(self, principal: Principal, tenant: str, action: Action) -> TenantId:
        """The checked tenant id, or PermissionDenied. Validates the id's shape first."""
        tenant_id = parse_tenant_id(tenant)
        if tenant_id not in principal.tenants or action not in principal.actions:
            raise PermissionDenied(
                f"principal {principal.name!r} may not {action.value} this tenant; "
                "grant it in the server config ([[principals]] tenants/actions)"
            )
        return tenant_id

    def visible_tenants(self, principal: Principal) -> frozenset[TenantId]:
        return principal.tenants

    def is_admin(self, principal: Principal) -> bool:
        return Action.ADMIN in principal.actions

    def epoch(self, tenant: TenantId) -> int:
        return self._namer.epoch(tenant)

    def storage_key(self, tenant: TenantId, model: ModelName, digest: BlockDigest) -> StorageKey:
        return self._namer.storage_key(tenant, model, digest)
