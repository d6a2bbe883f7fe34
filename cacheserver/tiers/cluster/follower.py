"""Deletes from other servers, and the cluster's upkeep, on one background thread.

The follower reads the delete stream from where this server left it (the position is
saved in the data dir, `cluster.position`) and drops this server's copies of what each
entry deletes. When it cannot know what it missed — first start, a position older than
the stream's first entry (trimmed), a stream that vanished with its node — it
*reconciles* instead: every local copy whose block the cluster no longer holds is
dropped (a deleted block, or one evicted there: either way a miss costs only a
recompute, while serving a deleted block would be wrong). It does this once before the
server serves when the cluster answers at start-up, and again whenever it reconnects
after an outage too long for the stream.

Upkeep, every few seconds: connect if not connected, re-read the slot map when asked,
reclaim retired epochs (blocks named under a tenant's old epoch: unreachable, so
deleted, as `recovery.rebuild_index` does for LMDB), and sweep evicted blocks that a
server which crashed mid-eviction left behind.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from cacheserver.tiers import LocalCopies
from cacheserver.tiers.cluster import deletes, layout
from cacheserver.tiers.cluster.deletes import DeleteEntry
from cacheserver.tiers.cluster.nodes import Failed
from cacheserver.tiers.cluster.parts import ClusterParts
from cacheserver.tiers.cluster.replies import StreamEntry
from cacheserver.tiers.cluster.sharing import Sharing
from policy.types import ModelTag

log = logging.getLogger(__name__)
POSITION_FILE = "cluster.position"
READ_COUNT = 256
# The largest delete stream entry taken in: ours are at most 256 keys (8 KiB) and an
# origin; a larger one is read past, never held (a writer to Redis may plant any size),
# so one read holds at most READ_COUNT x this (3 MiB).
MAX_ENTRY_BYTES = 12 << 10
RECONCILE_CHUNK = 1024
SAVE_EVERY_S = 1.0
SWEEP_EVERY_S = 10.0
RECLAIM_EVERY_S = 30.0
RECONNECT_EVERY_S = 1.0
START = b"0-0"


def announce(tier: ClusterParts, entries: Sequence[DeleteEntry]) -> bool:
    """Append deletes to the stream for the other servers; False if it failed."""
    stream = tier.keys.deletes
    split: list[DeleteEntry] = []
    for entry in entries:
        split += deletes.split_keys(sorted(entry.keys)) if entry.keys else [entry]
    commands = []
    for entry in split:
        fields = deletes.to_fields(tier.origin, entry)
        flat = [part for pair in fields.items() for part in pair]
        limit = tier.config.delete_stream_entries
        commands.append((stream, ("XADD", stream, "MAXLEN", "~", limit, "*", *flat)))
    return not any(isinstance(answer, Failed) for answer in tier.nodes.run(commands))


def _stream_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.partition(b"-")
    return int(ms), int(seq or 0)


class Follower:
    def __init__(self, tier: ClusterParts, local: LocalCopies, sharing: Sharing) -> None:
        self._tier = tier
        self._local = local
        self._sharing = sharing
        self._path = tier.data_dir / POSITION_FILE
        self.position: bytes | None = None  # None: unknown, reconcile before following
        self._saved: bytes | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._due = {"save": 0.0, "sweep": 0.0, "reclaim": 0.0}
        self._warned_epochs: set[tuple[bytes, int]] = set()
        self._stream_ends = tier.nodes.register(layout.STREAM_ENDS)

    # -- start and stop ------------------------------------------------------------------

    def catch_up(self) -> None:
        """Before serving: connect, and apply what this server missed (or reconcile)."""
        if not self._tier.nodes.connect():
            log.warning(
                "the Redis Cluster does not answer (%s); serving local tiers only until it "
                "does (deletes made meanwhile reach this server then)",
                self._tier.nodes.last_error,
            )
            return
        self._resume(self._load_position())
        self._reclaim_retired()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="kvshare-cluster-follower", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._save(force=True)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # a bug here must not end delete propagation
                log.exception("the Redis Cluster follower failed; retrying")
                self.position = None
                self._stop.wait(RECONNECT_EVERY_S)

    def _step(self) -> None:
        tier = self._tier
        if not tier.nodes.is_connected and not tier.nodes.connect():
            self._stop.wait(RECONNECT_EVERY_S)
            return
        if self.position is None:
            self._resume(self._saved)
            if self.position is None:
                self._stop.wait(RECONNECT_EVERY_S)
                return
        self._follow()
        self._upkeep()

    def _follow(self) -> None:
        tier = self._tier
        assert self.position is not None
        stream = tier.keys.deletes
        block_ms = max(1, min(500, tier.config.timeout_ms // 2))
        entries = tier.nodes.read_stream(
            stream, self.position, READ_COUNT, block_ms, MAX_ENTRY_BYTES
        )
        if isinstance(entries, Failed):
            self.position = None  # reconnect and check what was missed
            self._stop.wait(min(1.0, tier.config.retry_after_ms / 1000))
            return
        if len(entries) == READ_COUNT and not self._covers(self.position):
            self._reconcile()  # behind by more than the stream keeps
        self._apply(entries)

    def _upkeep(self) -> None:
        now = time.monotonic()
        if now >= self._due["save"]:
            self._due["save"] = now + SAVE_EVERY_S
            self._save()
        if now >= self._due["sweep"]:
            self._due["sweep"] = now + SWEEP_EVERY_S
            self._sweep()
        if now >= self._due["reclaim"]:
            self._due["reclaim"] = now + RECLAIM_EVERY_S
            self._reclaim_retired()
        self._tier.nodes.refresh_if_wanted()

    # -- catching up -----------------------------------------------------------------------

    def _resume(self, saved: bytes | None) -> None:
        """Follow from `saved` if the stream still holds everything after it, else
        reconcile and follow from the stream's end. With no position ever saved this
        server has not been part of the cluster: nothing it holds can have been deleted
        through another server, so it shares its blocks instead of dropping them."""
        if saved is not None and self._covers(saved):
            self.position = saved
            return
        last = self._last_id()
        if last is None:
            return
        if saved is None and not self._path.exists():
            self._share_local()
        else:
            self._reconcile()
        self.position = last
        self._save(force=True)

    def _share_local(self) -> None:
        tier, local = self._tier, self._local
        for tenant in tier.tenants.values():
            for key, model_tag in local.local_keys(tenant.id):
                self._sharing.enqueue(tenant, key, model_tag, None)

    def _ends(self) -> list[bytes] | Failed:
        """[first id, last id, last generated id] of the stream ([]: no stream), by ids
        alone (layout.STREAM_ENDS): XINFO and XREVRANGE would send whole entries."""
        stream = self._tier.keys.deletes
        answer = self._tier.nodes.script(self._stream_ends, [stream], [])
        return answer if isinstance(answer, Failed) else [bytes(a) for a in answer]

    def _covers(self, position: bytes) -> bool:
        """Whether every entry after `position` is still in the stream."""
        ends = self._ends()
        if isinstance(ends, Failed) or not ends:
            return False  # no stream (its node lost it, or none was ever written)
        first, _, generated = ends
        if not first:  # empty: trimmed to nothing
            return _stream_id(generated or START) <= _stream_id(position)
        return _stream_id(first) <= _stream_id(position) or position == START

    def _last_id(self) -> bytes | None:
        ends = self._ends()
        if isinstance(ends, Failed):
            return None
        return (ends[1] or ends[2] or START) if ends else START

    def _reconcile(self) -> None:
        """Drop every local copy of a block the cluster does not hold (module docstring)."""
        tier, local = self._tier, self._local
        pending = self._sharing.pending()
        dropped = 0
        for tenant in tier.tenants.values():
            held = [k for k, _ in local.local_keys(tenant.id) if k not in pending]
            for start in range(0, len(held), RECONCILE_CHUNK):
                chunk = held[start : start + RECONCILE_CHUNK]
                names = [tier.keys.block(key) for key in chunk]
                answers = tier.nodes.run([(n, ("EXISTS", n)) for n in names])
                gone = [key for key, a in zip(chunk, answers, strict=True) if a == 0]
                if gone:
                    dropped += local.forget_local(gone)
        tier.count(reconciled=dropped)
        if dropped:
            log.info("dropped %d local block(s) the Redis Cluster no longer holds", dropped)

    def _apply(self, entries: list[StreamEntry]) -> None:
        tier, local = self._tier, self._local
        for raw_id, fields in entries:
            self.position = raw_id
            parsed = None if fields is None else deletes.from_fields(fields)
            if parsed is None:  # too large, or not ours: passed, counted, never logged
                tier.count(stream_skipped=1)
                continue
            if parsed[0] == tier.origin:
                continue
            entry = parsed[1]
            tier.deletes.record(entry)
            if entry.tenant_tag:
                tenant = tier.by_tag.get(entry.tenant_tag)
                if tenant is not None:
                    model = ModelTag(entry.model_tag) if entry.model_tag else None
                    local.forget_local(namespace=(tenant.id, model))
            else:
                local.forget_local(sorted(entry.keys))
            tier.count(deletes_applied=1)

    # -- upkeep ----------------------------------------------------------------------------

    def _reclaim_retired(self) -> None:
        tier = self._tier
        for tenant in tier.tenants.values():
            epochs = tier.accounting.epochs(tenant)
            if isinstance(epochs, Failed):
                continue
            for epoch in sorted(epochs):
                if epoch < tenant.epoch:
                    held, _ = tier.erasure.delete_tenant_blocks(tenant, None, [epoch])
                    log.info("reclaimed %d block(s) of a retired epoch from the cluster", len(held))
                elif epoch > tenant.epoch and (tenant.tag, epoch) not in self._warned_epochs:
                    self._warned_epochs.add((tenant.tag, epoch))
                    log.warning(
                        "another server uses tenant %r at epoch %d, this one at %d: give every "
                        "server the same tenants config",
                        tenant.id,
                        epoch,
                        tenant.epoch,
                    )

    def _sweep(self) -> None:
        tier = self._tier
        for tenant in tier.tenants.values():
            leftovers = tier.accounting.sweep(tenant)
            if leftovers:
                names = [tier.keys.block(key) for key in leftovers]
                tier.nodes.run([(n, ("DEL", n)) for n in names])

    def _load_position(self) -> bytes | None:
        with contextlib.suppress(OSError):
            prefix, _, position = self._path.read_bytes().strip().partition(b" ")
            if prefix == tier_prefix(self._tier) and position:
                self._saved = position
                return position
        return None

    def _save(self, *, force: bool = False) -> None:
        position = self.position
        if position is None or (position == self._saved and not force):
            return
        temporary = self._path.with_suffix(".tmp")
        try:
            temporary.write_bytes(tier_prefix(self._tier) + b" " + position + b"\n")
            temporary.replace(self._path)
            self._saved = position
        except OSError as error:
            log.warning("cannot save the delete stream position (%s)", error.strerror)


def tier_prefix(tier: ClusterParts) -> bytes:
    return tier.config.key_prefix.encode()
