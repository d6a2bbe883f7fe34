"""One-time tickets that open a bulk-channel connection.

The gRPC call `OpenBulk` authenticates the caller and authorizes it for a tenant, then
issues a ticket: 32 random bytes, valid once, for `ttl_s`, bound to that principal and
tenant. Presenting it on the bulk listener binds the connection to the same principal
and tenant; every request on the connection is still authorized by `AccessPolicy.admit`
and named by `AccessPolicy.storage_key`, so the bulk path skips no policy check — the
ticket only stands in for the credential, which never crosses the bulk channel.

Only the SHA-256 of a ticket is kept, so the registry holds nothing that could be
replayed if it leaked; lookup is by that hash, so its timing reveals nothing useful.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcommon.encoding import enc
from kvcommon.errors import Unauthenticated
from policy.identity import Principal
from policy.types import TenantId

TICKET_BYTES = 32
LOCAL_BINDING_LABEL = "kvshare/bulk/local/v1"
DEFAULT_TTL_S = 30.0
MAX_OUTSTANDING = 65536  # bound the registry against a caller minting tickets in a loop


@dataclass(frozen=True)
class Grant:
    principal: Principal
    tenant: TenantId
    # The sealed-payload channel's secret (policy.bulkchannel), or b"": a TLS ticket.
    channel_secret: bytes = field(default=b"", repr=False)


class TicketBook:
    """Outstanding tickets, oldest first. A full book drops the expired ones from its
    front, then the oldest: both O(1) per ticket issued, so a caller minting tickets
    in a loop costs each OpenBulk microseconds, not a scan of the whole book."""

    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        # sha256(ticket) -> (grant, deadline); deadlines increase with insertion order
        self._grants: OrderedDict[bytes, tuple[Grant, float]] = OrderedDict()

    def issue(
        self, principal: Principal, tenant: TenantId, *, channel_secret: bytes = b""
    ) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = self._clock()
        with self._lock:
            if len(self._grants) >= MAX_OUTSTANDING:
                self._expire(now)
            if len(self._grants) >= MAX_OUTSTANDING:
                self._grants.popitem(last=False)  # the oldest
            self._grants[hashlib.sha256(ticket).digest()] = (
                Grant(principal, tenant, channel_secret),
                now + self.ttl_s,
            )
        return ticket

    def peek(self, ticket: bytes) -> Grant | None:
        """The grant of a valid, unused, unexpired ticket, left in the book: the sealed
        channel checks the client's proof of the channel secret before it redeems."""
        with self._lock:
            entry = self._grants.get(hashlib.sha256(ticket).digest())
        if entry is None or len(ticket) != TICKET_BYTES or entry[1] < self._clock():
            return None
        return entry[0]

    def redeem(self, ticket: bytes) -> Grant:
        """The grant of a valid, unused, unexpired ticket; Unauthenticated otherwise."""
        key = hashlib.sha256(ticket).digest()
        with self._lock:
            entry = self._grants.pop(key, None)
        if entry is None or len(ticket) != TICKET_BYTES or entry[1] < self._clock():
            raise Unauthenticated("bulk ticket is invalid, used or expired; call OpenBulk again")
        return entry[0]

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)

    def _expire(self, now: float) -> None:
        while self._grants and next(iter(self._grants.values()))[1] < now:
            self._grants.popitem(last=False)


def local_binding(ticket: bytes, host_namespace: str, uid: int) -> str:
    """Where a same-host listener may be used, bound to one ticket (OpenBulk's
    `local_namespace`): the server computes it from its own namespace and uid, a client
    from its own namespace and the listener's peer uid, and only equal values let the
    ticket be presented there. The ticket is a one-time random key, so the value tells
    a remote caller neither the boot id nor the uid."""
    message = enc(LOCAL_BINDING_LABEL, host_namespace, str(uid))
    return hmac.digest(ticket, message, "sha256").hex()


def is_local_binding(ticket: bytes, host_namespace: str, uid: int, binding: str) -> bool:
    """The client's check of `local_binding` (constant time)."""
    return hmac.compare_digest(local_binding(ticket, host_namespace, uid), binding)
