"""A stopped server's data files as a disk holds them: read where they have data, flip
a stored bit."""

from __future__ import annotations

import os
from pathlib import Path


def read_allocated(path: Path) -> bytes:
    """The bytes of `path` where it has data: LMDB's file is sparse up to its map size
    (gigabytes), only its start holds pages."""
    chunks = []
    with open(path, "rb") as f:
        fd, end, offset = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while offset < end:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # no data after offset
                break
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            chunks.append(os.pread(fd, stop - start, start))
            offset = stop
    return b"".join(chunks)


def flip_stored_byte(data_file: Path, near: bytes, offset: int) -> None:
    """Flip one bit `offset` bytes into the first place `near` is stored in `data_file`
    (a stopped server's LMDB file), as a failing disk would."""
    with open(data_file, "r+b") as f:
        fd, end, position = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while position < end:
            start = os.lseek(fd, position, os.SEEK_DATA)
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            where = os.pread(fd, stop - start, start).find(near)
            if where >= 0:
                at = start + where + offset
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
                return
            position = stop
    raise AssertionError("the block's bytes are not in the data file")
