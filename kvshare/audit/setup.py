"""What a timing audit is given and what it plants: the two parties (a tenant and a
principal's token each), the target and its options (`Setup`), the transports an
attacker could use, and the digest pools made before any timing (`Planted`).

Blocks are planted under a model name of their own ("kvshare-audit/<random>"), never
colliding with real data, and deleted afterwards (kvshare.audit.parties).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from policy.types import PUBLIC
from replica_agent.client import ClientTls

PUBLIC_TENANT: str = PUBLIC  # the reserved tenant id of the public scope, "@public"
PUBLIC_BLOCK_BYTES = 64 << 10  # one block per public trial (a read from disk: 16 pages)
# A get's block: a 32-token KV block of a 7B-class model. On a server with a Redis
# Cluster tier a miss asks the cluster, and over the same-host arena that costs about
# what taking 1 MiB does: a hit of this size stays apart from a miss there too.
BLOCK_BYTES = 2 << 20
PLANTED = 8  # blocks of BLOCK_BYTES each party plants for the get arms
# Digests per lookup (a 64k-token prompt at 16 tokens a block): a hit walks the whole
# run. On a server with a Redis Cluster tier a miss asks the cluster, which costs about
# what walking 1024 local entries does; a run this long keeps hits apart from misses there.
LOOKUP_RUN = 4096
RUN_BLOCK_BYTES = 1 << 10  # the lookup arms' blocks: a lookup never reads a payload
TIMEOUT_S = 10.0
DIGEST_BYTES = 32


class AuditError(Exception):
    """A usage or connection problem (exit 2); the message says what to change."""


@dataclass(frozen=True)
class Party:
    """A tenant and the token of a principal acting for it; `flag` names the option
    that gave the token, for messages."""

    tenant: str
    token: str
    flag: str


@dataclass(frozen=True)
class Setup:
    target: str
    attacker: Party
    victim: Party
    tls: ClientTls | None = None
    publisher_token: str | None = None
    probes: int = 400
    timeout_s: float = TIMEOUT_S
    # The public check (kvshare.audit.public): the deployment's other servers, the
    # bytes of other puts that move published blocks out of the put journal first,
    # and data files (on this host) whose cold pages are evicted before each trial.
    also_targets: tuple[str, ...] = ()
    public_settle_bytes: int = 0
    evict_files: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Transport:
    """How the attacker's client reaches the store (BlockClient's options)."""

    name: str
    bulk: bool
    same_host: bool

    @property
    def lookups(self) -> bool:
        """Whether to time lookups here: on every transport (BlockClient sends them
        over the bulk channel when it is up, else over gRPC)."""
        return True


def transports(*, tls: bool) -> list[Transport]:
    """Every transport an attacker could use; over TLS the same ones, named so."""
    suffix = "+tls" if tls else ""
    return [
        Transport(f"grpc{suffix}", bulk=False, same_host=False),
        Transport(f"bulk-tcp{suffix}", bulk=True, same_host=False),
        Transport(f"same-host{suffix}", bulk=True, same_host=True),
    ]


@dataclass(frozen=True)
class Pool:
    """One party's digests: `blocks` (PLANTED, for gets) and `runs` (2 * LOOKUP_RUN,
    for lookups). A lookup takes LOOKUP_RUN consecutive digests of `runs`, cyclic."""

    blocks: list[bytes]
    runs: list[bytes]

    @classmethod
    def fresh(cls) -> Pool:
        return cls(random_digests(PLANTED), random_digests(2 * LOOKUP_RUN))

    def block(self, i: int) -> bytes:
        return self.blocks[i % len(self.blocks)]

    def run(self, i: int) -> list[bytes]:
        return [self.runs[(i + k) % len(self.runs)] for k in range(LOOKUP_RUN)]


@dataclass
class Planted:
    """The audit's digest pools (made before any timing) under its own model name."""

    model: str
    victim: Pool  # stored by the victim in its tenant
    own: Pool  # stored by the attacker in its own tenant (the control)
    random: Pool  # stored by nobody
    public: list[bytes] = field(default_factory=list)  # published under PUBLIC_TENANT

    @classmethod
    def fresh(cls) -> Planted:
        model = f"kvshare-audit/{os.urandom(8).hex()}"
        return cls(model, Pool.fresh(), Pool.fresh(), Pool.fresh())


def random_digests(count: int = PLANTED) -> list[bytes]:
    return [os.urandom(DIGEST_BYTES) for _ in range(count)]
