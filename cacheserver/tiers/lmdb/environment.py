"""The LMDB environment's shape, the same for the server (`tier`) and the bulk workers
that read it (`reader`): its databases, its reader table, and how a read transaction
begins when that table may be full.
"""

from __future__ import annotations

import lmdb

from kvcommon.errors import Unavailable

BLOCKS_DB, META_DB = b"blocks", b"meta"
MAX_DBS = 8
# Read transactions open at once, across every process (the lock file's table, 64 bytes
# a slot): above lmdb_readers_needed for any valid configuration (400 at the specs'
# maxima, 344 with 8 workers; tests/unit/cacheserver/tiers/lmdb/test_lmdb_readers.py).
# The server, opening the environment first, sizes the table; the workers take its size
# from the lock file.
MAX_READERS = 1024


def begin_read(env: lmdb.Environment) -> lmdb.Transaction:
    """A read transaction; UNAVAILABLE, saying so, when LMDB's reader table is full
    (after one reader check: a process that died may have held the slots)."""
    try:
        return env.begin(buffers=True)
    except lmdb.ReadersFullError:
        env.reader_check()
    try:
        return env.begin(buffers=True)
    except lmdb.ReadersFullError:
        raise Unavailable(
            f"every one of LMDB's {env.max_readers()} reader slots is in use; retry "
            "shortly (the blocks are still stored)"
        ) from None
