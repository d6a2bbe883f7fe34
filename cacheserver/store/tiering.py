"""`IndexedTiers`: the tiers the store composes, the index over them (the authority on
what they hold), and the one lock that guards both.

Invariants:
- The index is the authority on what exists here. Every block it lists is held by the
  put journal (acknowledged, not yet drained: `JournaledPuts`) or by LMDB, the first
  lower tier, and reads fall through in that order (then through any tier behind
  LMDB). The memory tier holds a subset of the index, never more.
- A block enters the index (becomes visible) only once a crash of the server can no
  longer lose it: after its LMDB commit, or after its journal record is committed.
- First writer wins: a key already in the index is never written again.
- The index, the memory tier and the journaled-put state change only under `lock`;
  lower tiers are called outside it (blocking I/O).
- Tiers behind LMDB (none by default) get every block LMDB commits, after the commit
  (written behind: their failures never fail a put), and every delete (`Lineup`).

The facade and the local copies (`local`) use the verbs here, never the index or the
lock: each verb takes the lock itself where it needs it, and says when it blocks. The
journal's puts (`journaled`), the LMDB commit (`commit`), the writer and the recovery at
start-up are parts of the same machinery under the same lock: they work on the index
and the tiers directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from cacheserver.events import EvictReason, StoreEvents
from cacheserver.store.held import HeldPuts
from cacheserver.store.jobs import Evicted, PutJob, PutPlan
from cacheserver.store.lineup import Lineup
from cacheserver.tiers import Payload
from cacheserver.tiers.index import BlockIndex, NoRoom
from kvcommon.errors import ResourceExhausted
from policy.types import ModelTag, StorageKey, TenantId


class IndexedTiers:
    def __init__(self, index: BlockIndex, lineup: Lineup, events: StoreEvents) -> None:
        self.lock = threading.Lock()
        self.index = index
        self.lineup = lineup
        self.memory = lineup.memory
        self.disk = lineup.disk
        self.events = events
        # Set once at start-up when puts are journaled (cacheserver.store.journaled).
        self.journaled: HeldPuts | None = None
        # time.monotonic() of the last request the store served (lookup, get, put): the
        # writer drains the journal when requests pause (Writer._wait_for_quiet).
        self.last_activity = 0.0
        # Why the last commit failed, until the health probe has seen it (probe()).
        self.commit_failure: str | None = None
        # Journal records dropped at replay because their bytes failed their checksum
        # (LMDB counts its own corrupt blocks: LmdbTier.integrity_failures).
        self.journal_integrity_failures = 0

    # -- admission (under `lock`) ----------------------------------------------------

    def plan(self, batch: Sequence[PutJob]) -> PutPlan:
        """Reserve room for the batch in the index, job after job, as if each were put
        on its own: the admitted jobs, the entries their room evicted, and the jobs a
        later job of the same batch evicted again (`PutPlan`)."""
        admitted: dict[StorageKey, PutJob] = {}
        evicted: Evicted = []
        superseded: list[tuple[PutJob, EvictReason]] = []
        for job in batch:
            if job.key in self.index or job.key in admitted:
                job.future.set_result(False)
                self.events.put_outcome(job.tenant, "already_present", len(job.payload))
                continue
            try:
                victims = self.index.victims_with_reasons(job.tenant, len(job.payload))
            except NoRoom as error:
                job.future.set_exception(self.no_room(job.tenant, len(job.payload), error))
                continue
            for victim, reason in victims.items():
                entry = self.index.remove(victim)
                if victim in admitted:
                    # Evicted by a later block of its own batch: it never reaches LMDB.
                    # Writing it anyway would leave its tenant over quota (and the store
                    # over budget) once the batch commits; a put call or a journal replay
                    # of several blocks must end where the same puts one by one would.
                    superseded.append((admitted.pop(victim), reason))
                elif entry is not None:
                    evicted.append((victim, entry, reason))
                    self.disk.retire(victim)  # bulk workers: out until its delete commits
            self.index.add(job.key, job.tenant, len(job.payload), tag=job.model_tag)
            job.clock = self.index.clock
            admitted[job.key] = job
        return PutPlan(list(admitted.values()), evicted, superseded)

    def no_room(self, tenant: TenantId, size: int, error: NoRoom) -> ResourceExhausted:
        self.events.quota_rejected(tenant)
        self.events.put_outcome(tenant, "rejected", size)
        return ResourceExhausted(
            f"no room for a {size}-byte block: {error.reason}; raise the "
            "tenant's quota_bytes or [storage] disk_budget_bytes"
        )

    def note_stored(self, job: PutJob) -> None:
        """A new block is stored (under `lock`): count it and keep it hot."""
        self.events.put_outcome(job.tenant, "stored", len(job.payload))
        if self.memory.admit(job.key, job.tenant, job.payload):
            self.events.stored(job.tenant, "memory", len(job.payload))

    def remove_everywhere(self, keys: Sequence[StorageKey]) -> None:
        """Forget `keys` in the index and the in-process tiers (under `lock`): a
        journaled block of them not yet in LMDB is passed over by the writer."""
        for key in keys:
            self.index.remove(key)
        self.memory.delete(keys)
        if self.journaled is not None:
            self.journaled.delete(keys)

    # -- commits (cacheserver.store.commit) ---------------------------------------------

    def note_commit_failure(self, error: Exception) -> None:
        """An LMDB commit failed: the next health probe says so (under `lock`)."""
        self.commit_failure = f"an LMDB commit failed ({type(error).__name__})"

    # -- reads (the facade's) ---------------------------------------------------------

    def touch(self, keys: Iterable[StorageKey]) -> None:
        """Touch each of `keys` the index lists as used (blocks served elsewhere)."""
        with self.lock:
            for key in keys:
                self.index.touch(key)

    def touch_leading(self, keys: Sequence[StorageKey]) -> int:
        """How many of `keys`, leading, the index lists; each is touched as used."""
        with self.lock:
            self.last_activity = time.monotonic()
            present = 0
            for key in keys:
                if not self.index.touch(key):
                    break
                present += 1
        return present

    def _more(self, keys: Sequence[StorageKey], served: int) -> bool:
        """Whether the key after the `served` leading ones may be held (under `lock`)."""
        return served < len(keys) and (keys[served] in self.index or self.lineup.asks_on_miss)

    def read_from_memory(
        self, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads held in memory (about `max_bytes` of them, at least one),
        and whether the key after them may be held. Never blocks."""
        out: list[Payload] = []
        total = 0
        memory, index = self.memory, self.index
        with self.lock:
            self.last_activity = time.monotonic()
            for key in keys:
                if out and total >= max_bytes:
                    break
                payload = memory.get(key)
                if payload is None or not index.touch(key):
                    break
                out.append(payload)
                total += len(payload)
            return out, self._more(keys, len(out))

    def read_through(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads (about `max_bytes`, at least one) read through the journal
        and the lower tiers and promoted to memory, and whether the key after them may
        be held; a first key the index does not list is asked of the shared tiers.
        Blocking."""
        journaled = self.journaled
        with self.lock:
            wanted: list[StorageKey] = []
            total = 0
            for key in keys:
                entry = self.index.get(key)
                if entry is None or (wanted and total + entry.size > max_bytes):
                    break
                wanted.append(key)
                total += entry.size
            held = journaled.held(wanted) if journaled is not None else {}
        if not wanted:
            return self.lineup.read_shared(tenant, keys, max_bytes)
        below = [key for key in wanted if key not in held]
        read = self.lineup.read_below(below) if below else {}
        out: list[Payload] = []
        with self.lock:
            for key in wanted:
                payload = held[key] if key in held else read[key]
                if payload is None:
                    if journaled is None or not journaled.holds(key):  # not put again
                        self.remove_everywhere([key])  # corrupt or gone: a miss from now on
                    return out, False
                # A view of a journal record is not promoted: the record may have been
                # drained and its space reclaimed since it was taken above, and the
                # memory tier must never keep such a view past the reclaim. Nor is a
                # fixed-order block (the public scope): what is hot must not depend on
                # who read what.
                touched = self.index.touch(key)
                promote = key not in held and tenant not in self.memory.fixed_order
                if touched and promote and self.memory.admit(key, tenant, payload):
                    self.events.stored(tenant, "memory", len(payload))
                out.append(payload)
            return out, self._more(keys, len(out))

    # -- puts (the facade's and the journal's) -----------------------------------------

    def _present(self, tenant: TenantId, key: StorageKey, size: int) -> bool:
        """Whether `key` is stored already (under `lock`): touched and counted if so."""
        if key not in self.index:
            return False
        self.index.touch(key)
        self.events.put_outcome(tenant, "already_present", size)
        return True

    def _room_for(self, tenant: TenantId, size: int) -> None:
        """Raise ResourceExhausted if a block of `size` bytes cannot be admitted."""
        try:
            self.index.victims_with_reasons(tenant, size)
        except NoRoom as error:
            raise self.no_room(tenant, size, error) from None

    def already_present(self, tenant: TenantId, key: StorageKey, size: int) -> bool:
        """Whether `key` is stored already (first writer wins): touched and counted."""
        with self.lock:
            return self._present(tenant, key, size)

    def admissible(self, tenant: TenantId, key: StorageKey, size: int) -> bool:
        """False when `key` is stored already (touched, counted); raises
        ResourceExhausted when a block of `size` bytes has no room; else True."""
        with self.lock:
            if self._present(tenant, key, size):
                return False
            self._room_for(tenant, size)
            return True

    def check_room(self, tenant: TenantId, key: StorageKey, size: int) -> None:
        """Raise ResourceExhausted now if a block of `size` bytes could not be admitted;
        a key stored already is not refused (nor touched: nothing was put yet)."""
        with self.lock:
            if key not in self.index:
                self._room_for(tenant, size)

    # -- deletes -----------------------------------------------------------------------

    def set_quotas(
        self, quotas_bytes: Mapping[TenantId, int], memory_quotas_bytes: Mapping[TenantId, int]
    ) -> list[StorageKey]:
        """New quotas (a live config reload): each tenant over its new quota loses its
        least recently used blocks until it is within it, here and in the in-process
        tiers (other tenants keep theirs); returns those keys for the tiers below."""
        with self.lock:
            self.index.quotas_bytes = dict(quotas_bytes)
            self.memory.set_quotas(memory_quotas_bytes)
            victims: list[StorageKey] = []
            for tenant, quota in quotas_bytes.items():
                excess = self.index.tenant_bytes(tenant) - quota if quota else 0
                for key in self.index.keys_of(tenant):
                    if excess <= 0:
                        break
                    entry = self.index.get(key)
                    excess -= entry.size if entry is not None else 0
                    victims.append(key)
            self.remove_everywhere(victims)
        return victims

    def forget(self, keys: Sequence[StorageKey]) -> list[StorageKey]:
        """Take `keys` out of the index and the in-process tiers; those it listed."""
        with self.lock:
            present = [k for k in keys if k in self.index]
            self.remove_everywhere(keys)
        return present

    def forget_namespace(self, tenant: TenantId, model_tag: ModelTag | None) -> list[StorageKey]:
        """As `forget`, for every block the index lists of a tenant (or of one model)."""
        with self.lock:
            keys = self.index.keys_of(tenant, model_tag)
            self.remove_everywhere(keys)
        return keys

    def swept(self, tenant: TenantId, model_tag: ModelTag | None) -> list[StorageKey]:
        """The keys LMDB holds of a tenant (or of one model), listed or not. Blocking."""
        return [
            meta.key
            for meta in self.disk.scan()
            if meta.tenant == tenant and (model_tag is None or meta.model_tag == model_tag)
        ]

    # -- this server's own copies (`local.StoreCopies`, for a shared tier) -------------

    def local_keys(self, tenant: TenantId) -> list[tuple[StorageKey, ModelTag]]:
        """The keys the index lists of `tenant`, each with its model tag."""
        index = self.index
        with self.lock:
            return [(k, ModelTag(e.tag)) for k in index.keys_of(tenant) if (e := index.get(k))]

    def read_local(self, key: StorageKey) -> Payload | None:
        """The local payload of an indexed block (memory, journal or LMDB), or None.
        A journal record's view is valid only while the caller is pinned. Blocking."""
        with self.lock:
            if key not in self.index:
                return None
            payload = self.memory.get(key)
            if payload is None and self.journaled is not None:
                payload = self.journaled.held([key]).get(key)
        return payload if payload is not None else self.disk.read_many([key])[0]

    # -- figures -----------------------------------------------------------------------

    def tenant_usage(self, tenant: TenantId) -> tuple[int, int]:
        with self.lock:
            return self.index.tenant_blocks(tenant), self.index.tenant_bytes(tenant)

    def usage(self) -> dict[str, tuple[int, int, int]]:
        """tier name -> (blocks, bytes, budget_bytes): the memory tier's own figures,
        and the index's for the tiers it lists (the journal and LMDB, as "lmdb")."""
        index = self.index
        with self.lock:
            memory = self.memory.counts()
            return {
                "memory": (memory["blocks"], memory["bytes"], memory["budget_bytes"]),
                "lmdb": (len(index), index.used_bytes, index.budget_bytes),
            }

    @property
    def undrained_blocks(self) -> int:
        with self.lock:
            return self.journaled.undrained_blocks if self.journaled is not None else 0

    @property
    def integrity_failures(self) -> int:
        """Corrupt blocks dropped: read from LMDB, or found in the journal at replay."""
        return self.disk.integrity_failures + self.journal_integrity_failures

    # -- lifecycle -------------------------------------------------------------------

    def probe(self) -> str | None:
        """Why the store cannot take writes, or None. Blocking. A commit that failed
        since the last probe counts once even if the tiers' own probes pass."""
        with self.lock:
            failure, self.commit_failure = self.commit_failure, None
        return self.lineup.probe() or failure

    def close(self) -> None:
        """Close every tier, fastest first: the memory tier lets go of its views of
        journal records before the journal is unmapped."""
        self.memory.close()
        if self.journaled is not None:
            self.journaled.close()
        for tier in self.lineup.lower:
            tier.close()
