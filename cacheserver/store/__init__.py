"""The block store: a memory tier over the put journal and LMDB, and any tiers behind
them, composed through the one tier interface of `cacheserver.tiers`, with one writer
thread.

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
- `tiering`: `IndexedTiers`, the index and the in-process state under one lock, and
  the verbs the rest of the store uses: admission (`plan`), reads, puts' checks,
  deletes, figures; it knows the journaled puts only as `HeldPuts` (`held`);
- `commit`: `commit_batch`, the LMDB commit of new blocks (write-through puts, the
  journal's replay), then their entry in the index;
- `lineup`: `Lineup`, the tiers as one ordered list, sorted once by what each declares
  (`cacheserver.tiers.Capability`), and the verbs across them;
- `journaled`: `JournaledPuts`, the journal as the store's own tier: records reserved,
  committed or given up, blocks not yet drained, the memory tier's views of records;
- `writer`: the writer thread: group commit, drain of journaled puts, barriers;
- `recovery`: start-up: index rebuild, reclamation of retired epochs, journal replay;
- `local`: `StoreCopies`, what a tier may ask of this server's own copies;
- `backlog` (bytes waiting for the writer), `jobs` (what threads hand each other),
  `upkeep` (periodic fsync, journal prefaulting).

The tiers, fastest first:

    memory    MemoryTier      in process, under the lock; an inclusive LRU cache
    journal   JournaledPuts   the store's own, under the lock; acknowledged, not in LMDB
    lmdb      LmdbTier        the first lower tier: the index is rebuilt from it
    behind    lower_tiers=    further tiers, in order, none by default (the Redis
                              Cluster, `cacheserver.tiers.cluster`, with [redis_cluster])

How a tier behind LMDB plugs in (docs/architecture.md, "Adding a tier", has the
checklist). It is one module under `cacheserver/tiers/` with a class that implements
`cacheserver.tiers.Tier` — `read_many`, `write`, `delete`, `probe`, `start`, `stop`,
`close`, `counts`, a `name` and its `capabilities`: blocking, thread-safe, never called
under the store's lock — and the server assembly passes it from its configuration
section: `BlockStore(..., lower_tiers=[tier])`. From then on (`Lineup`):
- Reads fall through to it (`Lineup.read_below`): a key the index lists that neither
  the journal nor LMDB can return (a local copy found corrupt, say) is read from it,
  served and promoted to memory like an LMDB read.
- Writes reach it after the local commit, on the writer thread: `commit.commit_batch`
  (write-through puts, the replay at start-up) and `Writer._drain` (journaled puts)
  hand `Lineup.write_behind` the blocks LMDB has just committed. Written behind: a
  failure there fails no put (each is acknowledged already); it is logged, and the
  tier's `probe` says why. A crash between the local commit and the write behind
  loses the copy below, never the block. A slow tier should queue internally rather
  than hold up the writer, and declare `QUEUED_WRITES`: its `write` then answers what
  it took on, and its `counts` what landed.
- Deletes reach it: `Lineup.delete_below` asks every tier behind LMDB to delete every
  key asked (it may hold blocks this index no longer lists), except a `SHARED` tier,
  whose deletes `BlockStore.delete` and `delete_tenant` make through it
  (`Lineup.delete_shared`) so that they reach the other servers. Local evictions never
  reach a tier behind: its own capacity and quotas govern what it keeps.
- `BlockStore.probe` asks it after LMDB, unless it declares `OWN_HEALTH` (the server
  keeps serving without it; the assembly publishes its probe as a health service of
  its own). The store starts it once it exists, handing it `StoreCopies` (the tier's
  only way to this server's copies: no tier holds the store), stops it first when it
  closes, and closes it last.

What the index is authoritative for. Without a `SHARED` tier: existence — a key not in
the index is a miss, and the journal and LMDB hold exactly the indexed blocks (besides
records the writer will pass over). With one (`cacheserver.tiers.cluster`): what this
server holds locally. An index miss then asks the shared tiers, in `BlockStore.lookup`
after the index walk (the gRPC Lookup handler runs on a worker thread once
`lookup_blocks` is true) and in `IndexedTiers.read_through` when the first key is not
indexed; what they return is kept as a local copy (`StoreCopies.keep_copy`). Deletes
made through other servers arrive through the shared tier's delete stream and drop
this server's copies (`StoreCopies.forget_local`); the shared tier reclaims retired
epochs itself.
"""

from cacheserver.store.facade import BlockStore

__all__ = ["BlockStore"]
