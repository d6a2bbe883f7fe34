"""A model of what the block store must hold, and the checks of an observed state.

The model is exact between steps: after every step the harness reads every name of
the small universe back from the real server (`observe`) and reconciles it here.
What a step may change is bounded, step by step:

- reads, refused calls: nothing changes;
- a put of tenant T: its newly stored blocks appear with their bytes; blocks may be
  evicted only from T (over its quota) or from tenants without a quota (over the
  budget), only when room was needed, never more than needed, and never the last
  block the put stored; a tenant within its quota never loses a block;
- a delete that succeeded: exactly those blocks are gone, and stay gone;
- a clean restart: nothing changes;
- kill -9: nothing acknowledged is lost. With the put journal, LMDB may still hold
  blocks evicted since the last drain and the replay re-runs eviction with the clocks
  LMDB has (recency is not persisted), so a tenant that evicted since the last
  restart may come back with a different choice of its blocks: the same number of
  them, each one it held or evicted since, with exact bytes. Without the journal,
  or for a tenant that evicted nothing, exactly what it held.

Names are (tenant, model, digest); a name's bytes are `payload(name, version)`, with a
new version for every put, so a block served under the wrong name, a stale version
after a delete, or a torn block never matches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Name = tuple[str, str, bytes]  # tenant, model, digest


class ModelViolation(AssertionError):
    """The server's state is not one the model allows."""


def payload(name: Name, version: int, size: int) -> bytes:
    tenant, model, digest = name
    seed = b"|".join((tenant.encode(), model.encode(), digest, str(version).encode()))
    return hashlib.shake_256(seed).digest(size)


@dataclass(frozen=True)
class TenantRules:
    block_bytes: int  # every block of the tenant has this size (counts are then exact)
    quota_bytes: int  # 0: no quota (evictable for the global budget)


@dataclass
class StoreModel:
    tenants: Mapping[str, TenantRules]
    budget_bytes: int
    present: dict[Name, bytes] = field(default_factory=dict)
    # Names evicted since the last restart, with every version they had: with the journal, a
    # kill -9 may bring these back instead of others of the same tenant.
    evicted: dict[Name, set[bytes]] = field(default_factory=dict)
    versions: dict[Name, int] = field(default_factory=dict)
    # Known bugs (by name) whose violations are counted in `tolerated` instead of raised,
    # so that the rest of the campaign still runs while each has its own xfail test.
    tolerate: frozenset[str] = frozenset()
    tolerated: dict[str, int] = field(default_factory=dict)

    def violation(self, bug: str, message: str) -> None:
        if bug not in self.tolerate:
            raise ModelViolation(message)
        self.tolerated[bug] = self.tolerated.get(bug, 0) + 1

    def next_payload(self, name: Name, size: int | None = None) -> bytes:
        version = self.versions.get(name, 0) + 1
        self.versions[name] = version
        return payload(name, version, size or self.tenants[name[0]].block_bytes)

    def leading(self, tenant: str, model: str, digests: Iterable[bytes]) -> list[bytes]:
        """What a get of these digests must return: the leading present blocks."""
        out = []
        for digest in digests:
            value = self.present.get((tenant, model, digest))
            if value is None:
                break
            out.append(value)
        return out

    def of_tenant(self, names: Iterable[Name], tenant: str) -> set[Name]:
        return {n for n in names if n[0] == tenant}

    def tenant_bytes(self, state: Mapping[Name, bytes], tenant: str) -> int:
        return sum(len(v) for n, v in state.items() if n[0] == tenant)

    # -- reconciling an observed state ----------------------------------------------

    def expect_unchanged(self, observed: Mapping[Name, bytes], step: str) -> None:
        if dict(observed) != self.present:
            raise ModelViolation(f"{step}: {_diff(self.present, observed)}")

    def expect_deleted(
        self, observed: Mapping[Name, bytes], gone: Iterable[Name], step: str
    ) -> None:
        gone = set(gone)
        expected = {n: v for n, v in self.present.items() if n not in gone}
        if dict(observed) != expected:
            raise ModelViolation(f"{step}: {_diff(expected, observed)}")
        self.present = expected
        for name in gone:  # a successful delete is final, even for an evicted copy
            self.evicted.pop(name, None)

    def expect_put(
        self,
        observed: Mapping[Name, bytes],
        tenant: str,
        stored: Mapping[Name, bytes],
        last_stored: Name | None,
        step: str,
    ) -> None:
        """A put of `tenant` stored `stored` (name -> new bytes); see the module doc."""
        candidates = {**self.present, **stored}
        for name, value in observed.items():
            if candidates.get(name) != value:
                raise ModelViolation(f"{step}: {_describe(name)} served bytes it never held")
        lost = {n: v for n, v in candidates.items() if n not in observed}
        rules = self.tenants[tenant]
        for name in lost:
            owner = self.tenants[name[0]]
            within = self.tenant_bytes(self.present, name[0]) <= owner.quota_bytes
            if name[0] != tenant and owner.quota_bytes and within:
                raise ModelViolation(
                    f"{step}: {_describe(name)} of a tenant within its quota was evicted by "
                    f"a put of {tenant}"
                )
            if name == last_stored:
                raise ModelViolation(f"{step}: the block the put just stored is missing")
        used_after = sum(len(v) for v in observed.values())
        tenant_after = self.tenant_bytes(observed, tenant)
        if rules.quota_bytes and tenant_after > rules.quota_bytes:
            self.violation(
                "same-batch-eviction", f"{step}: {tenant} holds {tenant_after} bytes over its quota"
            )
        if used_after > self.budget_bytes:
            self.violation(
                "same-batch-eviction", f"{step}: {used_after} bytes stored, over the budget"
            )
        if lost:
            smallest = min(len(v) for v in lost.values())
            over_quota = rules.quota_bytes and tenant_after + rules.block_bytes > rules.quota_bytes
            if not over_quota and used_after + smallest <= self.budget_bytes:
                raise ModelViolation(
                    f"{step}: {len(lost)} blocks evicted though the put had room without"
                )
        # A block evicted by an earlier block of the same call and then stored again
        # was evicted too: its old bytes may still be in LMDB or the journal.
        for name in stored:
            if name in self.present:
                self.evicted.setdefault(name, set()).add(self.present[name])
        for name, value in lost.items():
            self.evicted.setdefault(name, set()).add(value)
        self.present = dict(observed)

    def expect_after_kill(self, observed: Mapping[Name, bytes], journal: bool, step: str) -> None:
        """Nothing acknowledged lost; see the module doc for what the journal allows."""
        for tenant in self.tenants:
            held = {n: v for n, v in self.present.items() if n[0] == tenant}
            now = {n: v for n, v in observed.items() if n[0] == tenant}
            evicted = {n: v for n, v in self.evicted.items() if n[0] == tenant}
            if not journal or not evicted:
                if now != held:
                    raise ModelViolation(f"{step}: {tenant}: {_diff(held, now)}")
                continue
            for name, value in now.items():
                if value != held.get(name) and value not in evicted.get(name, ()):
                    raise ModelViolation(f"{step}: {_describe(name)} served bytes it never held")
            if len(now) > len(held):
                self.violation(
                    "same-batch-eviction",
                    f"{step}: {tenant} held {len(held)} blocks before kill -9 and {len(now)} after",
                )
            elif len(now) < len(held):
                raise ModelViolation(
                    f"{step}: {tenant} held {len(held)} blocks before kill -9 and "
                    f"{len(now)} after (lost: {sorted(_describe(n) for n in set(held) - set(now))})"
                )
        self.present = dict(observed)
        self.evicted.clear()

    def restarted(self) -> None:
        self.evicted.clear()


def _describe(name: Name) -> str:
    tenant, model, digest = name
    return f"{tenant}/{model}/{digest[:4].hex()}"


def _diff(expected: Mapping[Name, bytes], observed: Mapping[Name, bytes]) -> str:
    missing = sorted(_describe(n) for n in expected if n not in observed)
    extra = sorted(_describe(n) for n in observed if n not in expected)
    wrong = sorted(_describe(n) for n in expected if n in observed and observed[n] != expected[n])
    return f"missing {missing}, unexpected {extra}, wrong bytes {wrong}"
