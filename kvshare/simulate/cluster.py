"""The replica pool a router sees: each replica's local cache, queue and routed work.

Replica ids are never reused: a replica that leaves takes its cache with it, and one
that joins later gets a fresh id and a cold cache. `active` keeps join order, which
round robin cycles through and scale-in picks from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshare.simulate.caches import BlockCache, make_block_cache
from kvshare.simulate.timing import ReplicaQueue


@dataclass
class Replica:
    """One inference replica and what happened to it during the replay."""

    cache: BlockCache
    routed_tokens: int = 0
    fair_share_tokens: float = 0.0
    queue: ReplicaQueue = field(default_factory=ReplicaQueue)


class Cluster:
    """All replicas ever created; `active` lists the ids a router may pick now."""

    def __init__(self, replica_capacity_blocks: int | None, block_tokens: int) -> None:
        self._replica_capacity_blocks = replica_capacity_blocks
        self.block_tokens = block_tokens
        self.replicas: list[Replica] = []
        self.active: list[int] = []

    def add_replica(self) -> int:
        """Start a replica with a cold cache; return its id."""
        replica_id = len(self.replicas)
        self.replicas.append(Replica(make_block_cache(self._replica_capacity_blocks)))
        self.active.append(replica_id)
        return replica_id

    def remove_replica(self, replica_id: int) -> None:
        """Stop routing to a replica; its cache is lost, its queued work still completes."""
        self.active.remove(replica_id)

    def record_routing(self, replica_id: int, tokens: int) -> None:
        """Count tokens routed to a replica; every active replica's fair share grows equally."""
        self.replicas[replica_id].routed_tokens += tokens
        fair_share = tokens / len(self.active)
        for active_id in self.active:
            self.replicas[active_id].fair_share_tokens += fair_share

    def load_imbalance(self) -> float:
        """Max over mean of each replica's routed tokens relative to its fair share.

        With a fixed pool this is plain max/mean of routed tokens. With joins and leaves
        a replica is measured against an equal split of the traffic that arrived while
        it was in the pool, so traffic that varies over time does not count as imbalance.
        """
        ratios = [
            replica.routed_tokens / replica.fair_share_tokens
            for replica in self.replicas
            if replica.fair_share_tokens > 0
        ]
        mean_ratio = sum(ratios) / len(ratios) if ratios else 0.0
        return max(ratios) / mean_ratio if mean_ratio > 0 else 1.0
