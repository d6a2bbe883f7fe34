"""The values that cross between a transport and the request core.

A transport decodes its frames into the arguments of a verb (`Verb`, a principal, a
tenant, a model, digests, sizes) and encodes what the verb returns: a count, `Served`
batches of a GET, put outcomes, a `BulkOffer`, a `StatsView`. Nothing here holds a
store or a socket.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cacheserver.blocks import Payload
from cacheserver.events import TenantCounts
from kvcommon.errors import InvalidArgument
from policy import Action, Principal
from policy.tickets import TicketBook
from policy.types import ModelName, ModelTag, StorageKey, TenantId

# A GET reads at most this much from the disk tier per batch: large enough that one
# read transaction serves a long prefix, small enough to start sending early.
DISK_BATCH_BYTES = 64 << 20

# Whether a GET's transport takes this payload into its reply. The first payload it
# does not take ends the reply there: the blocks from it on are neither served nor
# missed (the caller asks again, or counts them as a miss, as its protocol says).
Accept = Callable[[Payload], bool]


class Verb(enum.Enum):
    """What a request does to a tenant's blocks; `action` is what it needs there."""

    LOOKUP = "lookup"
    GET = "get"
    PUT = "put"
    DELETE = "delete"
    DELETE_NAMESPACE = "delete_namespace"

    @property
    def action(self) -> Action:
        return _ACTIONS[self._value_]  # by value: a str's hash, not Enum.__hash__'s call


_ACTIONS = {
    Verb.LOOKUP.value: Action.READ,
    Verb.GET.value: Action.READ,
    Verb.PUT.value: Action.WRITE,
    Verb.DELETE.value: Action.WRITE,  # a delete by digest needs `write`, like a put
    Verb.DELETE_NAMESPACE.value: Action.ADMIN,
}


@dataclass(frozen=True, slots=True)
class Begun:
    """A request whose header passed the first stage of admission (rate, tenant and
    action, digest count): what the core's verbs take. Only admission makes one
    (cacheserver.core.checks.RequestChecks.begin), so no verb runs on a request that
    skipped those checks."""

    principal: Principal
    verb: Verb
    tenant: TenantId
    count: int  # digests the request announced (0: a put stream, counted per block)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request whose model and digests are checked: its storage keys."""

    principal: Principal
    tenant: TenantId
    model: ModelName
    keys: Sequence[StorageKey]


@dataclass(frozen=True, slots=True)
class PutNamespace:
    """A put's tenant and model, admitted once; blocks are named one by one."""

    principal: Principal
    tenant: TenantId
    model: ModelName
    tag: ModelTag


@dataclass(frozen=True, slots=True)
class Announced:
    """Block `index` of a put, admitted (digest, size, room in the quota) before any of
    its bytes are taken."""

    index: int
    key: StorageKey
    size: int
    held: bool  # its size is taken from the receive budget until the store has it


@dataclass(frozen=True, slots=True)
class Served:
    """A batch of a GET's reply: blocks `first_index`.. of the request, all from one
    tier. `final`: no batch follows. Payloads stay valid until the next batch is asked
    for or the reply is released (cacheserver.store.reading)."""

    first_index: int
    payloads: Sequence[Payload]
    final: bool


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


def parse_model_bytes(raw: bytes | memoryview) -> str:
    """A model name as the bulk channel carries it: strict UTF-8, so two different byte
    strings can never name one model."""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument("model is not valid UTF-8; send the model name in UTF-8") from None
