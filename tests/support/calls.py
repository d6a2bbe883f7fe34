"""Record the calls a real client makes (the calls themselves are real)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from replica_agent.client import BlockClient

# Calls a client made, recorded by `record_calls`: (verb, tenant, digests).
Calls = list[tuple[str, str, tuple[bytes, ...]]]


def record_calls(client: BlockClient) -> Calls:
    """Record every call `client` makes from now on; the calls themselves are real."""
    calls: Calls = []

    def wrap(verb: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(tenant: str, model: str, digests: Sequence[bytes], *rest: Any) -> Any:
            calls.append((verb, tenant, tuple(digests)))
            return real(tenant, model, digests, *rest)

        return call

    for verb in ("lookup", "iter_views", "get", "put", "delete"):
        setattr(client, verb, wrap(verb, getattr(client, verb)))
    return calls


def sent_to(calls: Calls, tenant: str) -> set[bytes]:
    """Every digest the recorded calls named in `tenant`."""
    return {d for _, who, digests in calls if who == tenant for d in digests}


def puts(calls: Calls) -> list[tuple[str, tuple[bytes, ...]]]:
    """The recorded puts: (tenant, digests)."""
    return [(who, digests) for verb, who, digests in calls if verb == "put"]
