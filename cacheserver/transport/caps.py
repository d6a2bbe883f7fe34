"""A count capped in total and per principal: what bulk connections and same-host arenas
each hold, so one principal (one replica, or one stolen token) cannot take them all."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvcommon.errors import ResourceExhausted


class PrincipalCap:
    """Not thread-safe: the owner holds its own lock around `take` and `give_back`.
    `full` and `principal_full` word the refusals (what is held, what to do instead)."""

    def __init__(
        self,
        max_total: int,
        max_per_principal: int,
        full: Callable[[int], str],
        principal_full: Callable[[str, int], str],
    ) -> None:
        self.max_total = max_total
        self.max_per_principal = max_per_principal
        self._full = full
        self._principal_full = principal_full
        self.total = 0
        self._of: Counter[str] = Counter()

    def take(self, principal: str) -> None:
        """One more for `principal`, or ResourceExhausted saying which cap."""
        if self.total >= self.max_total:
            raise ResourceExhausted(self._full(self.max_total))
        if self._of[principal] >= self.max_per_principal:
            raise ResourceExhausted(self._principal_full(principal, self.max_per_principal))
        self.total += 1
        self._of[principal] += 1

    def give_back(self, principal: str) -> None:
        self.total -= 1
        self._of[principal] -= 1
        if not self._of[principal]:
            del self._of[principal]
