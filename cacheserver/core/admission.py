"""Admission: the one order in which every request is checked, on every transport.

    stage     check                                  refused with
    begin     1. the caller's request rate           RESOURCE_EXHAUSTED
              2. the tenant, and the verb's action   PERMISSION_DENIED (INVALID_ARGUMENT:
                                                     a malformed tenant id)
              3. the number of digests               INVALID_ARGUMENT
    name      4. the model name                      INVALID_ARGUMENT
              5. each digest (32 bytes)              INVALID_ARGUMENT
    announce  a put's block, as it is announced: 3 and 5 for it, then
              6. its size                            INVALID_ARGUMENT
              7. room in the tenant's quota          RESOURCE_EXHAUSTED
              8. room in the receive budget, for a   RESOURCE_EXHAUSTED
                 transport that holds the block's
                 bytes while they arrive (gRPC)
    then the verb; a put's bytes are checked (require_sealed) once complete.

`begin` needs only what a request's header carries, so the bulk channel refuses a
request before it reads the body; gRPC has the whole message and runs the stages back
to back. Either way the order is this one. Client digests become keyed storage names
here (`AccessPolicy.storage_key`) before anything else sees them. `begin` and `name`
are `cacheserver.core.checks.RequestChecks`, which a bulk read worker runs too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cacheserver.config import LimitsConfig
from cacheserver.core.checks import LiveLimits, RequestChecks
from cacheserver.core.values import Admitted, Announced, Begun, PutNamespace, Verb
from cacheserver.events import NoEvents
from cacheserver.store.backlog import WriteBacklog
from policy import AccessPolicy, Action, Principal
from policy.types import StorageKey, TenantId, parse_digest, parse_model

# The store's check that a block of `size` bytes fits the tenant's quota (raising
# ResourceExhausted), made before any of its bytes are taken.
RoomCheck = Callable[[TenantId, StorageKey, int], None]


class Admission:
    def __init__(
        self,
        policy: AccessPolicy,
        limits: LimitsConfig,
        check_room: RoomCheck,
        receive_bytes: int,
    ) -> None:
        """`receive_bytes`: the most bytes of blocks that transports may hold in memory
        while the blocks arrive (a gRPC Put stream assembles each block from chunks),
        over all tenants; one tenant: half."""
        self._policy = policy
        self.limits = LiveLimits(limits)  # a live reload replaces `current`
        self._checks = RequestChecks(policy, self.limits)
        self._check_room = check_room
        self._receiving = WriteBacklog(receive_bytes, NoEvents(), hurry=lambda: None)

    def count_request(self, principal: Principal) -> None:
        """Step 1 alone, for a verb that names no tenant (Stats)."""
        self._policy.check_rate(principal)

    def begin(
        self, principal: Principal, verb: Verb, tenant: str, count: int, *, rate_drawn: bool = False
    ) -> Begun:
        """Steps 1-3: what a request's header says. `rate_drawn`: step 1 was passed already,
        by a bulk worker that drew from the same bucket and handed the request back."""
        return self._checks.begin(principal, verb, tenant, count, rate_drawn=rate_drawn)

    def open_bulk(self, principal: Principal, tenant: str) -> TenantId:
        """Step 2 for a bulk ticket (after `count_request`): either action opens the
        connection; each request on it is admitted again, by `begin`."""
        action = Action.READ if Action.READ in principal.actions else Action.WRITE
        return self._policy.admit(principal, tenant, action)

    def name(self, begun: Begun, model: str, digests: Sequence[bytes]) -> Admitted:
        """Steps 4-5: the storage keys of a request that `begin` admitted."""
        return self._checks.name(begun, model, digests)

    def namespace(self, begun: Begun, model: str) -> PutNamespace:
        """Step 4 for a put, whose blocks are then announced one by one."""
        model_name = parse_model(model)
        tag = self._policy.model_tag(begun.tenant, model_name)
        return PutNamespace(begun.principal, begun.tenant, model_name, tag)

    def announce(
        self, put: PutNamespace, index: int, digest: bytes, size: int, *, hold: bool
    ) -> Announced:
        """Steps 3 and 5-8 for block `index` of `put`. `hold`: the transport keeps the
        block's bytes in memory until `handed_over`."""
        limits = self.limits.current
        limits.check_digest_count(index + 1)
        key = self._policy.storage_key(put.tenant, put.model, parse_digest(digest, index))
        limits.check_block_bytes(index, size)
        self._check_room(put.tenant, key, size)
        if hold:
            self._receiving.reserve(put.tenant, size, 0.0)
        return Announced(index, key, size, hold)

    def handed_over(self, put: PutNamespace, block: Announced) -> None:
        """The store has `block` (or gave it up): its bytes leave the receive budget."""
        if block.held:
            self._receiving.release(put.tenant, block.size)
