"""One-time tickets that open a bulk-channel connection.

The gRPC call `OpenBulk` authenticates the caller and authorizes it for a tenant, then
issues a ticket: 32 random bytes, valid once, for `ttl_s`, bound to that principal and
tenant. Presenting it on the bulk listener binds the connection to the same principal
and tenant; every request on the connection is still authorized by `AccessPolicy.admit`
and named by `AccessPolicy.storage_key`, so the bulk path skips no policy check — the
ticket only stands in for the credential, which never crosses the bulk channel.

Only the SHA-256 of a ticket is kept, so the registry holds nothing that could be
replayed if it leaked; lookup is by that hash, so its timing reveals nothing useful.

A ticket opens only the path it was issued for. The sealed-payload channel carries its
ticket in clear over plain TCP, guarded by a proof of the channel secret; such a ticket
is redeemable only on that channel, with that proof (`Route.SEALED`), or on the
same-host listener, which is not on the network — never as an ordinary ticket inside a
TLS connection of someone else's, which would bind the copier's
connection to the victim's principal and tenant. An ordinary ticket is refused on the
sealed channel. Under mutual TLS the grant remembers the certificate of the OpenBulk
caller (its SHA-256), and a TLS connection redeems it only with that same verified
certificate: a ticket lifted off the wire is useless to any other certificate holder.
A ticket refused for its route stays unspent, so a copier cannot burn the victim's
ticket either.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum

from kvcommon.encoding import enc
from kvcommon.errors import Unauthenticated
from policy.identity import Principal
from policy.types import TenantId

TICKET_BYTES = 32
LOCAL_BINDING_LABEL = "kvshare/bulk/local/v1"
DEFAULT_TTL_S = 30.0
MAX_OUTSTANDING = 65536  # bound the registry against a caller minting tickets in a loop


class Route(Enum):
    """How a bulk connection presents its ticket."""

    TLS = "tls"  # a TLS connection (plain TCP where the server has no TLS)
    LOCAL = "local"  # the same-host listener, reachable only inside the server's namespace
    SEALED = "sealed"  # the sealed-payload channel's hello, after the proof of its secret


@dataclass(frozen=True)
class Grant:
    principal: Principal
    tenant: TenantId
    # The sealed-payload channel's secret (policy.bulkchannel), or b"": a TLS ticket.
    channel_secret: bytes = field(default=b"", repr=False)
    # SHA-256 of the OpenBulk caller's verified client certificate (mutual TLS), else b"".
    peer_certificate: bytes = field(default=b"", repr=False)


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
        self,
        principal: Principal,
        tenant: TenantId,
        *,
        channel_secret: bytes = b"",
        peer_certificate: bytes = b"",
    ) -> bytes:
        """`peer_certificate`: the SHA-256 of the caller's verified client certificate
        (mutual TLS, `policy.identity.certificate_fingerprint`), which a TLS connection
        must present again to redeem the ticket."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = self._clock()
        with self._lock:
            if len(self._grants) >= MAX_OUTSTANDING:
                self._expire(now)
            if len(self._grants) >= MAX_OUTSTANDING:
                self._grants.popitem(last=False)  # the oldest
            self._grants[hashlib.sha256(ticket).digest()] = (
                Grant(principal, tenant, channel_secret, peer_certificate),
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

    def redeem(self, ticket: bytes, route: Route, tls_peer_certificate: bytes = b"") -> Grant:
        """The grant of a valid, unused, unexpired ticket issued for `route` (and, over
        TLS, for the client certificate the connection verified: its SHA-256);
        Unauthenticated otherwise, and a ticket refused for its route stays unspent.
        The one message for every refusal tells a copier nothing about which check
        failed."""
        key = hashlib.sha256(ticket).digest()
        with self._lock:
            entry = self._grants.get(key)
            if entry is not None and _opens(entry[0], route, tls_peer_certificate):
                del self._grants[key]
            else:
                entry = None
        if entry is None or len(ticket) != TICKET_BYTES or entry[1] < self._clock():
            raise Unauthenticated(
                "bulk ticket is invalid, used, expired or not for this connection; "
                "call OpenBulk again and present the ticket on the path it was issued for"
            )
        return entry[0]

    def revoke(self, principals: Collection[str]) -> int:
        """Drop every outstanding ticket of the named principals (a live reload revoked
        or reduced them: a ticket issued under the old grants opens nothing); returns
        how many were dropped."""
        with self._lock:
            doomed = [
                k for k, (grant, _) in self._grants.items() if grant.principal.name in principals
            ]
            for key in doomed:
                del self._grants[key]
        return len(doomed)

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)

    def _expire(self, now: float) -> None:
        while self._grants and next(iter(self._grants.values()))[1] < now:
            self._grants.popitem(last=False)


def _opens(grant: Grant, route: Route, tls_peer_certificate: bytes) -> bool:
    """Whether `grant` may be redeemed on `route` (see the module docstring)."""
    if route is Route.LOCAL:
        # The same-host listener is not on the network: only a process inside the
        # server's namespace reaches it, where a same-host client with a keyring uses
        # its sealed-channel ticket for the arena instead.
        return True
    if route is Route.SEALED:
        return bool(grant.channel_secret)
    if grant.channel_secret:
        return False
    return hmac.compare_digest(tls_peer_certificate, grant.peer_certificate)


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
