"""What a live config reload changes in who may do what (`AccessPolicy.reload_access`).

A reload names principals by `name`. One whose name is gone, or whose credential (its
token's SHA-256, or its certificate identity) differs, is *revoked*: whatever the old
credential opened is refused from then on. One that keeps its credential but loses
tenants, actions or has its rate changed is *reduced*: its requests are judged by the
new entry, and what it holds open under the old one (gRPC streams, bulk connections,
whose workers carry the old rate and grants) is closed, so it reconnects under the
new. A principal that only gains keeps everything open.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from policy.identity import Principal
from policy.types import TenantId


@dataclass(frozen=True)
class AccessChange:
    tenants_added: tuple[TenantId, ...] = ()
    tenants_removed: tuple[TenantId, ...] = ()
    principals_added: tuple[str, ...] = ()
    # name -> why what it holds open is closed: "removed", "credential replaced",
    # "grants reduced", "rate changed"
    closed: dict[str, str] = field(default_factory=dict)
    principals_widened: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line naming what changed (names only)."""
        parts = [
            f"{label} {', '.join(sorted(names))}"
            for label, names in (
                ("tenants added:", self.tenants_added),
                ("tenants removed:", self.tenants_removed),
                ("principals added:", self.principals_added),
                ("principals cut off:", tuple(self.closed)),
                ("principals widened:", self.principals_widened),
            )
            if names
        ]
        return "; ".join(parts) or "no change to tenants or principals"


def diff_access(
    old_principals: Iterable[Principal],
    new_principals: Iterable[Principal],
    old_tenants: Iterable[TenantId],
    new_tenants: Iterable[TenantId],
) -> AccessChange:
    old = {p.name: p for p in old_principals}
    new = {p.name: p for p in new_principals}
    closed: dict[str, str] = {}
    widened: list[str] = []
    for name, before in old.items():
        after = new.get(name)
        reason = _lost(before, after)
        if reason is not None:
            closed[name] = reason
        elif after is not None and after != before:
            widened.append(name)
    old_ids, new_ids = set(old_tenants), set(new_tenants)
    return AccessChange(
        tenants_added=tuple(sorted(new_ids - old_ids)),
        tenants_removed=tuple(sorted(old_ids - new_ids)),
        principals_added=tuple(sorted(new.keys() - old.keys())),
        closed=closed,
        principals_widened=tuple(sorted(widened)),
    )


def _lost(before: Principal, after: Principal | None) -> str | None:
    """Why `before` loses what it holds open, or None."""
    if after is None:
        return "removed"
    if after.credential != before.credential:
        return "credential replaced"
    if not (before.tenants <= after.tenants and before.actions <= after.actions):
        return "grants reduced"
    if after.requests_per_s != before.requests_per_s:
        return "rate changed"
    return None
