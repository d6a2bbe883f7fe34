"""The persistent tier: blocks in LMDB, verified on every read (a `Tier`).

Invariant: a block is visible only once all of its bytes and its checksum are
committed, and no read returns bytes whose checksum does not match: `blocks` (storage
key -> payload) and `meta` (storage key -> checksum, size, epoch, clock, model tag,
tenant) are written in one transaction, so a torn write is never visible, and reads
(`buffers=True`, zero-copy from the memory map) verify the xxh3-128 checksum before
anything leaves the read transaction; a mismatch deletes the block and is reported to
the caller as a miss. Two more databases: `health` holds one key that the health probe
rewrites to prove the tier still commits, and `journal` the put journal's checkpoint
(how far it is in LMDB), written in the same transaction as the blocks it covers.

The only module that imports `lmdb`. Blocking; thread-safe (LMDB's own transactions):
the store calls it outside its lock, reads on executor threads, writes on its writer.

Readers. LMDB's reader table (in its lock file, shared by every process that opens the
environment: the server and its bulk workers) has a slot for each read transaction
open at once; when none is free a read fails. So no read transaction here is held
across a wait on a peer (the server copies payloads out; a worker sends what the
socket takes at once and copies the rest: cacheserver.transport.bulk.readworker), the
table is sized above what every process can open at once (MAX_READERS, against
cacheserver.transport.bulk.readworkers.lmdb_readers_needed), a process that died
holding slots is cleared by LMDB's reader check (every READER_CHECK_INTERVAL_S here,
and by each bulk worker as it starts: a dead worker's snapshot would otherwise keep
every page freed after it from reuse, and the file would grow to the map's end), and a
table that is full anyway fails a read as UNAVAILABLE, with what to do, never as an
internal error.
Blocks the index has evicted but LMDB still holds are marked for the workers until
their delete commits (`retire`; cacheserver.tiers.retiring).

The package, by responsibility:
- `environment`: the environment's shape, the same for the server and the bulk workers
  that read it (databases, reader table), and how a read transaction begins;
- `records`: the bytes of a block's meta record and its checksum;
- `tier`: `LmdbTier`, the server's tier: commits, deletes, reads, space, health;
- `reader`: `LmdbReader`, the bulk workers' read-only view from another process.
"""
