"""The block store: a memory tier over the put journal and LMDB, composed through the
tier protocols of `cacheserver.tiers`, with one writer thread.

Invariants (each module states its own in detail):
- A block is visible (to lookup and get) only once a crash of the server can no longer
  lose it: after its LMDB commit, or, with the put journal, after its journal record
  is committed. That is also when its put is acknowledged.
- First writer wins: a key already stored is never overwritten.
- The index is the authority on what exists here; the memory tier only ever holds a
  subset of it. A journaled block not yet in LMDB is served from its record.
- LMDB never gets back a block the index dropped, not even by a replay after a crash.
- Index, memory-tier and journaled-put state change under one lock; the lower tiers
  (LMDB, and any tier behind it) are called outside it.

Modules, in the order to read them:
- `facade`: `BlockStore`, what the request core and the transports call;
- `tiering`: `Tiers`, the tiers and the index under one lock: admission (`plan`), the
  commit of new blocks, reads through the lower tiers, deletes across them;
- `journaled`: `JournaledPuts`, the journal as a tier: records reserved, committed or
  given up, blocks not yet drained, the memory tier's views of records;
- `writer`: the writer thread: group commit, drain of journaled puts, barriers;
- `recovery`: start-up: index rebuild, reclamation of retired epochs, journal replay;
- `backlog` (bytes waiting for the writer), `jobs` (what threads hand each other),
  `upkeep` (periodic fsync, journal prefaulting).

The tiers, fastest first:

    memory    MemoryTier      in process, under the lock; an inclusive LRU cache
    journal   JournaledPuts   in process, under the lock; acknowledged, not yet in LMDB
    lmdb      LmdbTier        the first lower tier: the index is rebuilt from it
    behind    lower_tiers=    further lower tiers, none by default (issue 17: the
                              Redis Cluster tier)

How a new lower tier plugs in. It is one module (e.g. `cacheserver/cluster_tier.py`)
with a class that implements `cacheserver.tiers.LowerTier` — `read_many`, `write`,
`delete`, `probe`, `close`: blocking, thread-safe, never called under the store's
lock — and the server assembly passes it from its configuration section:
`BlockStore(..., lower_tiers=[tier])`. From then on:
- Reads fall through to it in `Tiers.read_below`: a key the index lists that neither
  the journal nor LMDB can return (a local copy found corrupt, say) is read from it,
  served and promoted to memory like an LMDB read.
- Writes reach it after the local commit, on the writer thread: `Tiers.commit`
  (write-through puts, the replay at start-up) and `Writer._drain` (journaled puts)
  hand `Tiers.write_behind` the blocks LMDB has just committed. Written behind: a
  failure there fails no put (each is acknowledged already); it is logged, and the
  tier's `probe` says why. A crash between the local commit and the write behind
  loses the copy below, never the block. A slow tier should queue internally rather
  than hold up the writer.
- Deletes reach it: `Tiers.delete_below` asks every tier behind LMDB to delete every
  key asked (it may hold blocks this index no longer lists), except the shared tier,
  whose deletes `BlockStore.delete` and `delete_tenant` make themselves
  (`SharedTier.delete_held`, `delete_namespace`) so that they reach the other servers.
  Local evictions never reach a tier behind: its own capacity and quotas govern what
  it keeps.
- `BlockStore.probe` asks it after LMDB (`Tiers.probe`); `close` closes it last.

What the index is authoritative for. Without a shared tier: existence — a key not in
the index is a miss, and the journal and LMDB hold exactly the indexed blocks (besides
records the writer will pass over). With one (`cacheserver.tiers.cluster`, issue 17): what
this server holds locally. An index miss then asks the shared tier, in
`BlockStore.lookup` after the index walk (the gRPC Lookup handler runs on a worker
thread once `lookup_blocks` is true) and in `BlockStore.read_through` when the first key
is not indexed; what it returns is kept as a local copy (`local_copy`). Deletes made
through other servers arrive through the shared tier's delete stream and drop this
server's copies (`forget_local`); the shared tier reclaims retired epochs itself.
"""

from cacheserver.store.facade import BlockStore

__all__ = ["BlockStore"]
