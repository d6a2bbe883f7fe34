"""Which released ring space a reader may still be sending (`ReaderGenerations`).

A reader (a GET sending views of journal records) enters before it takes its views and
exits once they are sent. Each release of ring space starts a new generation; a reader
that entered in an older one may hold views of space released since, so that space is
not written again until every such reader has left (`Journal._wait_for_room`).

Not thread-safe on its own: the journal calls it under its lock.
"""

from __future__ import annotations


class ReaderGenerations:
    def __init__(self) -> None:
        self._generation = 0  # bumped each time space is released
        self._readers: dict[int, int] = {}  # generation entered -> readers still sending

    def enter(self) -> int:
        """A reader is about to send views of records; returns its token."""
        generation = self._generation
        self._readers[generation] = self._readers.get(generation, 0) + 1
        return generation

    def exit(self, token: int) -> bool:
        """The reader of `token` is done; whether it was the last of its generation."""
        left = self._readers[token] - 1
        if left:
            self._readers[token] = left
            return False
        del self._readers[token]
        return True

    def released(self) -> None:
        """Ring space was released: readers entered until now are stale for it."""
        self._generation += 1

    def any_stale(self) -> bool:
        """Whether a reader that entered before the latest release may still hold a
        view of released space."""
        return any(generation < self._generation for generation in self._readers)
