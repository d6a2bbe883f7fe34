"""Who may do what to which tenant: the one rule, with no state of its own.

`AccessPolicy.admit` applies it (and audits a denial); a bulk read worker applies it
too, in a process with no audit log, to the grants the server delegated with a
connection (cacheserver.core.readonly): the same function, so a worker can never allow
what the server would deny. Deny by default: a principal acts only for the tenants and
actions its config lists; the public scope's readers and writers are policy.access's
docstring's.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.identity import Action, Principal
from policy.types import PUBLIC, TenantId, parse_tenant_id


@dataclass(frozen=True, slots=True)
class PublicScope:
    """What the rule needs of the config beyond a principal's grants: whether there is a
    public scope, and which tenants' readers may read it (`read_public`)."""

    configured: bool
    reader_tenants: frozenset[TenantId]


def tenant_id(principal: Principal, tenant: str) -> TenantId:
    """The request's tenant id, its shape checked (InvalidArgument) unless it is one of
    the principal's own (validated when the config was read)."""
    return TenantId(tenant) if tenant in principal.tenants else parse_tenant_id(tenant)


def allows(principal: Principal, tenant: TenantId, action: Action, public: PublicScope) -> bool:
    """Whether `principal` may take `action` on `tenant`."""
    if tenant == PUBLIC:
        return public.configured and _allows_public(principal, action, public)
    return tenant in principal.tenants and action in principal.actions


def _allows_public(principal: Principal, action: Action, public: PublicScope) -> bool:
    publisher = Action.PUBLISH in principal.actions
    if action is Action.READ:
        return publisher or (
            Action.READ in principal.actions
            and not principal.tenants.isdisjoint(public.reader_tenants)
        )
    return publisher and action is Action.WRITE
