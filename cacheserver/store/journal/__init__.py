"""The put journal: acknowledged blocks in shared memory until LMDB holds them.

Why it exists. An acknowledged block must survive `kill -9` of the server (docs/design.md §6),
so it has to be in a file before the ack, not only in process memory. Writing it
straight into LMDB does that, but every byte then becomes a dirty page of a disk-backed
file, and once dirty pages pass the kernel's threshold (about 2 GB here) writers are
throttled to what the disk writes back: ~350-500 MB/s on this machine, measured with
plain LMDB commits and with `dd`. A file on tmpfs is never written back, so copying a
block into it runs at memory speed (~10 GB/s once its pages exist) and still survives
the process. The journal is that file: a ring of records on tmpfs (`/dev/shm` by
default). A put is acknowledged once its record is in the ring; the store's writer
thread moves blocks into LMDB behind it and then frees their space. After a crash the
store replays the records LMDB does not have yet, so nothing acknowledged is lost. A
host reboot clears tmpfs: what was acknowledged but not yet in LMDB then is gone —
at most the ring's capacity, and only cache entries, which replicas recompute.

The ring is mapped into the server, and the bulk channel receives a block straight
into its record (`reserve`, then `recv_into` the record's view, then `commit`): one
copy from the socket into memory whose pages exist already (prefaulted in the
background), where a heap buffer would first fault in every page (~4x slower here).
The memory tier then holds that view instead of a copy until the record's space is
reused; readers pin the views they send (`enter_read`), and space is not written
again while a reader that may hold a view of it is still sending.

Recovery follows the chain from the first record LMDB does not have (its offset and
sequence are committed with every drain, see `LmdbTier.write`), skips records still
RESERVED at the crash (never acknowledged) and stops at the first header that fails
its MAC or breaks the sequence. Space is reused only after LMDB has recorded that the
chain goes on past it.

The package, by responsibility:
- `format`: the bytes on file (superblock, headers, MAC) and the walk recovery replays;
- `ring`: the live ring (`Journal`): reserve, commit, drain, reclaim, readers;
- `space`: the ring's file space, taken ahead of the records (the prefaulter's pages);
- `ledger`: which records hold ring space, which are done, how far LMDB covers the chain;
- `readers`: which released space a reader may still be sending (by generation);
- `files`: where journal files live, how they are opened safely, orphans, page making.
- `sizing`: how big the journal is: the default fitted to the file system it goes on
  (a container's /dev/shm), a size set in the config checked against it.
The store's use of it (what is journaled, the views the memory tier holds, draining)
is in `cacheserver.store.journaled` and `cacheserver.store.writer`.
"""

from cacheserver.store.journal.files import (
    default_journal_path,
    new_journal_path,
    remove_journal,
    remove_orphans,
    replay,
)
from cacheserver.store.journal.format import ALIGN, DATA_START, Record, record_bytes
from cacheserver.store.journal.ring import MIN_CAPACITY, Journal, JournalFull, Reservation

__all__ = [
    "ALIGN",
    "DATA_START",
    "MIN_CAPACITY",
    "Journal",
    "JournalFull",
    "Record",
    "Reservation",
    "default_journal_path",
    "new_journal_path",
    "record_bytes",
    "remove_journal",
    "remove_orphans",
    "replay",
]
