"""Admission's first two stages, `begin` and `name` (cacheserver.core.admission has the
whole order), written once for every process that answers requests.

They ask a policy (`RequestPolicy`) for the rate, the tenant's permission and the
storage names, and the limits for the digest count. The server's `Admission` runs them
with its `AccessPolicy`; a bulk read worker (cacheserver.core.readonly), a process with
no audit log, store or server secret, runs them with a policy built from the grants the
server delegated with the connection. The same code, in the same order, so a worker can
never take for valid what the server would refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cacheserver.config import LimitsConfig
from cacheserver.core.values import Admitted, Begun, Verb
from policy import Action, Principal
from policy.types import (
    BlockDigest,
    ModelName,
    StorageKey,
    TenantId,
    parse_digest,
    parse_model,
)


class RequestPolicy(Protocol):
    """What admission asks of a policy (policy.AccessPolicy is one)."""

    def check_rate(self, principal: Principal) -> None:
        """One request from the principal's rate; ResourceExhausted past it."""
        ...

    def admit(self, principal: Principal, tenant: str, action: Action) -> TenantId:
        """The checked tenant id; PermissionDenied (InvalidArgument: a malformed id)."""
        ...

    def storage_keys(
        self, tenant: TenantId, model: ModelName, digests: Sequence[BlockDigest]
    ) -> list[StorageKey]: ...


class LiveLimits:
    """`[limits]` as the config serving now has them: each check reads `current`, which
    a live reload replaces whole (cacheserver.reloader; in a bulk worker, the server's
    update: cacheserver.transport.bulk.readworker), so a lowered limit holds from the
    next request on."""

    def __init__(self, limits: LimitsConfig) -> None:
        self.current = limits


class RequestChecks:
    def __init__(self, policy: RequestPolicy, limits: LiveLimits) -> None:
        self._policy = policy
        self.limits = limits

    def begin(
        self, principal: Principal, verb: Verb, tenant: str, count: int, *, rate_drawn: bool = False
    ) -> Begun:
        """Steps 1-3: what a request's header says. `rate_drawn`: step 1 was passed already,
        by a bulk worker that drew from the same bucket and handed the request back. Only
        step 1 raises ResourceExhausted."""
        if not rate_drawn:
            self._policy.check_rate(principal)
        tenant_id = self._policy.admit(principal, tenant, verb.action)
        self.limits.current.check_digest_count(count)
        return Begun(principal, verb, tenant_id, count)

    def name(self, begun: Begun, model: str, digests: Sequence[bytes]) -> Admitted:
        """Steps 4-5: the storage keys of a request that `begin` admitted."""
        assert len(digests) == begun.count, "the body holds the digests its header counted"
        model_name, parsed = _parse_names(model, digests)
        keys = self._policy.storage_keys(begun.tenant, model_name, parsed)
        return Admitted(begun.principal, begun.tenant, model_name, keys)


def _parse_names(model: str, digests: Sequence[bytes]) -> tuple[ModelName, list[BlockDigest]]:
    """Steps 4-5 before naming: the model name and each digest checked, what the
    policy then turns into storage keys."""
    model_name = parse_model(model)
    return model_name, [parse_digest(digest, index) for index, digest in enumerate(digests)]
