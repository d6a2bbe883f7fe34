"""What every part of the cluster tier shares: the connection to the nodes, the key
names, the quota accounting, the delete log and the counts (`ClusterParts`).

`ClusterTier` is these parts and the tier's verbs; its threads (`sharing`, `follower`)
are handed the parts, never the tier, so nothing here or there imports the tier. The
parts hold no thread of their own and call nothing of the store.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

from cacheserver.tiers.cluster.accounting import Accounting, Tenant
from cacheserver.tiers.cluster.config import RedisClusterConfig
from cacheserver.tiers.cluster.deletes import DeleteLog, Erasure
from cacheserver.tiers.cluster.layout import HEADER_BYTES, Keys
from cacheserver.tiers.cluster.nodes import ClusterNodes
from policy.shared_values import ValueMac


@dataclass
class ClusterCounts:
    """What the tier did since start (metrics: `kvshare.cluster.*`). No keys, no tenants."""

    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    failures: int = 0  # answers lost to a node that was down or erred (as misses)
    integrity_failures: int = 0
    written: int = 0
    written_bytes: int = 0
    dropped: int = 0  # writes not made (cluster unreachable, queue full, refused)
    evicted: int = 0  # blocks evicted for a tenant's quota by this server's writes
    promoted: int = 0  # blocks read from the cluster and kept locally
    deletes_applied: int = 0  # delete stream entries from other servers applied here
    stream_skipped: int = 0  # delete stream entries too large or not ours: read past
    reconciled: int = 0  # local copies dropped because the cluster no longer has them

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ClusterParts:
    def __init__(
        self,
        config: RedisClusterConfig,
        tenants: Iterable[Tenant],
        data_dir: Path,
        max_block_bytes: int,
        mac: ValueMac,
    ) -> None:
        self.config = config
        self.mac = mac  # tags values written, checks values read (layout.open_value)
        # The largest value a block key may hold: a bigger one is a miss, never read in.
        self.max_value_bytes = HEADER_BYTES + max_block_bytes
        self.tenants = {t.id: t for t in tenants}
        self.by_tag = {t.tag: t for t in self.tenants.values()}
        self.keys = Keys(config.key_prefix)
        self.nodes = ClusterNodes(config)
        self.accounting = Accounting(self.nodes, self.keys)
        self.deletes = DeleteLog()
        self.erasure = Erasure(self.nodes, self.keys, self.accounting)
        self.tally = ClusterCounts()
        self.counts_lock = threading.Lock()
        self.data_dir = data_dir
        self.origin = os.urandom(8)  # this server, in the delete stream's entries

    def count(self, **deltas: int) -> None:
        with self.counts_lock:
            for name, delta in deltas.items():
                setattr(self.tally, name, getattr(self.tally, name) + delta)

    def counts(self) -> dict[str, int]:
        with self.counts_lock:
            return self.tally.as_dict()
