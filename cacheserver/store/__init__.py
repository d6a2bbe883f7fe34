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
- Deletes reach it: `BlockStore.delete` asks it to delete every key asked (it may hold
  blocks this index no longer lists), `delete_tenant` every key the index lists of
  that tenant (`Tiers.delete_below`). Local evictions never reach it: its own
  capacity and quotas govern what it keeps.
- `BlockStore.probe` asks it after LMDB (`Tiers.probe`); `close` closes it last.

What the index is authoritative for. Without a tier behind LMDB: existence — a key not
in the index is a miss, and the journal and LMDB hold exactly the indexed blocks
(besides records the writer will pass over). With one: what this server holds (the
index is still rebuilt from LMDB alone) — a block that another server wrote, or that
this server evicted, is in the tier behind but not in the index, and is a miss here.
Turning those into hits is the part of issue 17 that is not one new module: a call on
an index miss in `BlockStore.lookup` (after the index walk; the gRPC Lookup handler
must then run off the event loop, as `lookup` never blocks today) and in
`BlockStore.read_through` (when the first key is not indexed), and the promotion of
what it returns into the local tiers. A shared tier also has to carry, on its own
side: tenant deletes of blocks this index does not list, deletes made through other
servers (they must drop this server's local copies: `BlockStore.delete` does that for
a list of keys), and the reclamation of retired epochs (as `recovery.rebuild_index`
does for LMDB).
"""

from cacheserver.store.facade import BlockStore

__all__ = ["BlockStore"]
