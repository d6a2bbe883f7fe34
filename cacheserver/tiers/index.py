"""Which blocks a tier holds, in what recency order, and what to evict.

Pure bookkeeping, no I/O: the tiers call it under their lock. Each tenant has its own
LRU order; a logical clock orders blocks across tenants. Eviction for an incoming block
of tenant T, in order:

1. T over its own quota: evict T's least recently used blocks (T pays for itself).
2. Over the tier budget: evict from tenants over their quota, then the globally least
   recently used block among tenants without a quota, then T's own blocks.
3. Still no room: refuse (the caller answers RESOURCE_EXHAUSTED).

A tenant within its quota is never evicted for another tenant's block.

Fixed-order namespaces (`fixed_order`; the public scope) keep their put order: a read
never reorders their blocks (`touch` leaves them), so which of them the tier keeps
depends on what was put, never on who read what (docs/isolation.md, public scope).

It lives among the tiers, not in the store, because both use it: the memory tier keeps
its LRU with it, and the store's authoritative index (`cacheserver.store.tiering`) is
one too. Tiers import nothing of the store.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from cacheserver.events import EvictReason
from policy.types import StorageKey, TenantId


@dataclass(slots=True)
class Entry:
    tenant: TenantId
    size: int
    clock: int
    tag: bytes = b""  # the block's model tag (disk index only; see policy.naming)


class NoRoom(Exception):
    """The block cannot be admitted without evicting a tenant within its quota."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BlockIndex:
    def __init__(
        self,
        budget_bytes: int,
        quotas_bytes: Mapping[TenantId, int] | None = None,
        fixed_order: frozenset[TenantId] = frozenset(),
    ) -> None:
        self.budget_bytes = budget_bytes
        self.quotas_bytes = dict(quotas_bytes or {})
        self.fixed_order = fixed_order
        self.used_bytes = 0
        self._entries: dict[StorageKey, Entry] = {}
        self._by_tenant: dict[TenantId, OrderedDict[StorageKey, Entry]] = {}
        self._tenant_bytes: dict[TenantId, int] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: StorageKey) -> Entry | None:
        return self._entries.get(key)

    def tenant_bytes(self, tenant: TenantId) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def tenant_blocks(self, tenant: TenantId) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def keys_of(self, tenant: TenantId, tag: bytes | None = None) -> list[StorageKey]:
        """The tenant's keys, or only those of one model tag."""
        if tag is not None:
            return [k for k, e in self._by_tenant.get(tenant, {}).items() if e.tag == tag]
        return list(self._by_tenant.get(tenant, ()))

    @property
    def clock(self) -> int:
        return self._clock

    def oldest_first(self) -> list[tuple[StorageKey, Entry]]:
        return sorted(self._entries.items(), key=lambda item: item[1].clock)

    def tenants(self) -> Iterator[TenantId]:
        return iter(self._by_tenant)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def touch(self, key: StorageKey) -> bool:
        """Whether `key` is listed; it becomes the most recently used unless its
        namespace keeps a fixed order."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.tenant in self.fixed_order:
            return True
        entry.clock = self._tick()
        self._by_tenant[entry.tenant].move_to_end(key)
        return True

    def add(
        self,
        key: StorageKey,
        tenant: TenantId,
        size: int,
        clock: int | None = None,
        tag: bytes = b"",
    ) -> None:
        """Record a block. The caller made room first (see `victims_for`)."""
        if key in self._entries:
            self.touch(key)
            return
        if clock is None:
            clock = self._tick()
        else:
            self._clock = max(self._clock, clock)
        entry = Entry(tenant, size, clock, tag)
        self._entries[key] = entry
        self._by_tenant.setdefault(tenant, OrderedDict())[key] = entry
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
        self.used_bytes += size

    def remove(self, key: StorageKey) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        blocks = self._by_tenant[entry.tenant]
        del blocks[key]
        if not blocks:
            del self._by_tenant[entry.tenant]
        self._tenant_bytes[entry.tenant] -= entry.size
        if not self._tenant_bytes[entry.tenant]:
            del self._tenant_bytes[entry.tenant]
        self.used_bytes -= entry.size
        return entry

    def victims_for(self, tenant: TenantId, size: int) -> list[StorageKey]:
        """Keys to evict, in order, so a block of `size` bytes of `tenant` fits.

        Does not change the index; raises NoRoom when the rules above forbid it.
        """
        return list(self.victims_with_reasons(tenant, size))

    def victims_with_reasons(self, tenant: TenantId, size: int) -> dict[StorageKey, EvictReason]:
        """Like `victims_for`, with why each goes: rule 1 (`quota`) or rule 2 (`budget`)."""
        quota = self.quotas_bytes.get(tenant, 0)
        if not quota and self.used_bytes + size <= self.budget_bytes:
            return {}  # room as it is (every put asks, several times: the common answer)
        if size > self.budget_bytes or (quota and size > quota):
            limit = min(self.budget_bytes, quota) if quota else self.budget_bytes
            raise NoRoom(
                f"block of {size} bytes exceeds the {limit}-byte limit of this tier/tenant"
            )
        planned: dict[StorageKey, int] = {}
        tenant_used = self.tenant_bytes(tenant)
        if quota:
            for key, entry in self._by_tenant.get(tenant, {}).items():
                if tenant_used + size <= quota:
                    break
                planned[key] = entry.size
                tenant_used -= entry.size
        own_quota = len(planned)  # the first victims are rule 1's
        used = self.used_bytes - sum(planned.values())
        if used + size > self.budget_bytes:
            for key, entry_size in self._global_candidates(tenant, planned):
                planned[key] = entry_size
                used -= entry_size
                if used + size <= self.budget_bytes:
                    break
        if used + size > self.budget_bytes:
            raise NoRoom("every remaining block belongs to a tenant within its quota")
        return {key: "quota" if i < own_quota else "budget" for i, key in enumerate(planned)}

    def victims_reserved(self, tenant: TenantId, size: int) -> dict[StorageKey, EvictReason]:
        """Like `victims_with_reasons`, for a fixed-order namespace whose share of the
        tier is reserved (the memory tier's public scope): only its own quota evicts
        its blocks (rule 1), never the tier budget; what the budget needs is taken from
        other tenants, in rule 2's order, and then from their least recently used
        blocks even within their quotas (in the memory tier their blocks stay stored
        below; only their hot copies go). Raises NoRoom for a block larger than its
        quota or the tier, or when only fixed-order blocks are left."""
        quota = self.quotas_bytes.get(tenant, 0)
        if size > self.budget_bytes or (quota and size > quota):
            limit = min(self.budget_bytes, quota) if quota else self.budget_bytes
            raise NoRoom(
                f"block of {size} bytes exceeds the {limit}-byte limit of this tier/tenant"
            )
        planned: dict[StorageKey, EvictReason] = {}
        tenant_used, used = self.tenant_bytes(tenant), self.used_bytes
        for key, entry in self._by_tenant.get(tenant, {}).items():
            if not quota or tenant_used + size <= quota:
                break
            planned[key] = "quota"
            tenant_used -= entry.size
            used -= entry.size
        # Rule 2's candidates first, walked lazily (a full tier asks on every put);
        # only when every other tenant is within its quota, their blocks by age (a
        # sort of the tier: publications are rare).
        candidates = itertools.chain(
            self._global_candidates(tenant, planned),
            ((key, entry.size) for key, entry in self._oldest_when_needed()),
        )
        for key, entry_size in candidates:
            if used + size <= self.budget_bytes:
                break
            owner = self._entries[key].tenant
            if key in planned or owner == tenant or owner in self.fixed_order:
                continue
            planned[key] = "budget"
            used -= entry_size
        if used + size > self.budget_bytes:
            raise NoRoom("the tier holds only fixed-order blocks")
        return planned

    def _oldest_when_needed(self) -> Iterator[tuple[StorageKey, Entry]]:
        """`oldest_first`, sorted only once the iteration gets here."""
        yield from self.oldest_first()

    def _global_candidates(
        self, tenant: TenantId, planned: Mapping[StorageKey, object]
    ) -> Iterator[tuple[StorageKey, int]]:
        """Eviction candidates for the global budget, in the order of the module docstring."""
        over = [
            t
            for t, q in self.quotas_bytes.items()
            if q and self.tenant_bytes(t) > q and t != tenant
        ]
        for other in over:
            excess = self.tenant_bytes(other) - self.quotas_bytes[other]
            for key, entry in self._by_tenant.get(other, {}).items():
                if excess <= 0:
                    break
                if key not in planned:
                    excess -= entry.size
                    yield key, entry.size
        yield from self._lru_among_unquoted(planned)
        for key, entry in self._by_tenant.get(tenant, {}).items():
            if key not in planned:
                yield key, entry.size

    def _lru_among_unquoted(
        self, planned: Mapping[StorageKey, object]
    ) -> Iterator[tuple[StorageKey, int]]:
        """Blocks of tenants without a quota, least recently used first, across tenants."""
        iters = {
            t: iter(blocks.items())
            for t, blocks in self._by_tenant.items()
            if not self.quotas_bytes.get(t, 0)
        }
        if len(iters) == 1:  # one such tenant (a full memory tier asks on every put)
            for key, entry in next(iter(iters.values())):
                if key not in planned:
                    yield key, entry.size
            return
        heads: dict[TenantId, tuple[StorageKey, Entry]] = {}
        for t, it in iters.items():
            head = next(it, None)
            if head is not None:
                heads[t] = head
        while heads:
            oldest = min(heads, key=lambda t: heads[t][1].clock)
            key, entry = heads[oldest]
            nxt = next(iters[oldest], None)
            if nxt is None:
                del heads[oldest]
            else:
                heads[oldest] = nxt
            if key not in planned:
                yield key, entry.size
