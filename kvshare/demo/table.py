"""The demo's two-column comparison, as every mode prints it."""

from __future__ import annotations

from collections.abc import Sequence


def side_by_side(left: str, right: str, rows: Sequence[tuple[str, str, str]]) -> list[str]:
    """A header naming the two runs, then one line per figure."""
    lines = [f"{'':<22}{left:>20}{right:>20}"]
    return lines + [f"{name:<22}{a:>20}{b:>20}" for name, a, b in rows]
