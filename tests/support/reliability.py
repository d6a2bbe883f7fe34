"""Types of the reliability suite's `serve` fixture."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from benchmarks.reliability.harness import (
    ServerProc,
    Tenancy,
)

Storage = Mapping[str, int | bool | str]
Serve = Callable[..., tuple[ServerProc, Tenancy]]
