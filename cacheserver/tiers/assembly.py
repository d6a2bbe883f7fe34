"""The tiers behind LMDB, opened from the server's config in one place (`open_tiers`),
and what the server's assembly reads of them: which health services they drive, which
metrics they feed, and whether reads may wait on them (`TierStack`).

Each kind of tier is one entry of `KINDS`: the config section that names it, the health
service its probe drives, and how to open it. Whatever differs between kinds past that
is what the opened tier declares (`Capability`), never a branch on which kind it is:

- `OWN_HEALTH`: the server serves without it; its `probe` drives a gRPC health service
  of its own (the kind's `health_service`), never the store's.
- `SHARED`: other servers use it too. The store asks it on an index miss, so a read may
  wait on the network: such reads stay off the bulk channel's ready loop. Its `counts`
  and reachability are the `kvshare.cluster.*` metrics (`ServerGauges.watch_cluster`:
  the Redis Cluster is the one shared tier today).

A kind's client library is imported when its section is present, never before: a
server without `[redis_cluster]` runs without redis-py installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cacheserver.config import ServerConfig
from cacheserver.tiers import Capability, SharedTier, Tier
from kvcommon.errors import ConfigError
from policy import AccessPolicy


@dataclass(frozen=True, slots=True)
class TierKind:
    """A kind of tier behind LMDB that a config section opens."""

    section: str  # the config section that names it (`[redis_cluster]`)
    # The gRPC health service its probe drives, when it declares `OWN_HEALTH`.
    health_service: str
    # The tier from the server's config, or None when its section is absent.
    open: Callable[[ServerConfig, AccessPolicy], Tier | None]


def _open_redis_cluster(config: ServerConfig, policy: AccessPolicy) -> Tier | None:
    """The Redis Cluster tier, when `[redis_cluster]` names one (cacheserver.tiers.cluster)."""
    if config.redis_cluster is None:
        return None
    try:
        from cacheserver.tiers.cluster.tier import open_cluster_tier
    except ImportError as error:
        raise ConfigError(
            f"[redis_cluster] needs the Python package {error.name!r}; "
            "pip install 'kvshare[cluster]'"
        ) from None
    return open_cluster_tier(
        config.redis_cluster, policy, config.data_dir, config.limits.max_block_bytes
    )


# In the order reads fall through them, after LMDB.
KINDS: tuple[TierKind, ...] = (
    # SERVING while every Redis node answers.
    TierKind("redis_cluster", "kvshare.cluster", _open_redis_cluster),
)


@dataclass(frozen=True, slots=True)
class HealthWatch:
    """A tier whose probe drives a gRPC health service of its own (`OWN_HEALTH`)."""

    service: str
    tier: Tier
    is_shared: bool  # its state is also the kvshare.cluster.reachable gauge


@dataclass(frozen=True, slots=True)
class TierStack:
    """The tiers behind LMDB the config names, in the order reads fall through them."""

    behind: tuple[Tier, ...]
    health: tuple[HealthWatch, ...]

    @property
    def shared(self) -> tuple[SharedTier, ...]:
        return tuple(
            t
            for t in self.behind
            if Capability.SHARED in t.capabilities and isinstance(t, SharedTier)
        )

    @property
    def reads_wait_on_network(self) -> bool:
        """Whether a read may wait on another machine (a shared tier asked on a miss):
        then no read is served on the bulk channel's ready loop."""
        return bool(self.shared)


def open_tiers(
    config: ServerConfig, policy: AccessPolicy, kinds: tuple[TierKind, ...] = KINDS
) -> TierStack:
    """Open every tier behind LMDB that the config names. Reads files now (a bad one
    stops the start-up, with a ConfigError); tiers connect when the store starts them."""
    behind: list[Tier] = []
    health: list[HealthWatch] = []
    for kind in kinds:
        tier = kind.open(config, policy)
        if tier is None:
            continue
        behind.append(tier)
        if Capability.OWN_HEALTH in tier.capabilities:
            is_shared = Capability.SHARED in tier.capabilities
            health.append(HealthWatch(kind.health_service, tier, is_shared))
    return TierStack(tuple(behind), tuple(health))
