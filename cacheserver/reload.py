"""Live reload: the server's config file read again and applied without a restart.

`kvshare serve --config FILE` reloads on SIGHUP and on the admin RPC `Reload`
(`kvshare admin reload`). A reload is all or nothing: the whole file is read, parsed and
checked first (every key's spec, as at start-up; the TLS files are read and must make a
working context), then compared with the running config. Anything wrong, or any change
that only a restart can make, refuses the whole reload with one line naming the file,
the line and the key, and the running config keeps serving; nothing is dropped.

What changes live: tenants (added; removed: their blocks are deleted, as a start-up
without them reclaims them), quotas (a tenant over a lowered one is evicted down to it
at once), principals (tokens, certificates, tenants, actions, rates),
`[limits]` (requests_per_s, request_burst_s, max_digests_per_call, max_block_bytes,
get_frame_bytes: each transport's next request is checked against the new ones, a bulk
worker's connections' too), read_public, require_sealed, the public scope's quota and
require_sealed, and the TLS certificate, key and client CA (new handshakes use them;
open connections keep theirs). Everything else sizes or binds something at start-up
(listen addresses, data_dir, the naming secret, budgets and files of `[storage]`,
`[bulk]`, `[telemetry]`, the cluster tier, a tenant's epoch, whether there is a public
scope or TLS or mTLS at all; `[limits] max_message_bytes`, which gRPC's message size
limits are built with; with a cluster tier, which tenants there are and their quotas,
and max_block_bytes, which that tier takes once) and needs a restart.
`cacheserver.reloader` applies a checked file to the running server.

Once applied, a principal that was removed, whose credential changed or that lost
tenants or actions keeps nothing it opened under the old config (policy.access_change):
its calls in flight end (cacheserver.transport.grpc.open_calls), its bulk connections
close on every path (cacheserver.transport.bulk.slots: bulk workers' connections
too), its unredeemed tickets are dropped (policy.tickets), and its next request is
judged by the new entry (policy.access.AccessPolicy.current). The audit log records the
reload and each principal cut off (names only); metrics show the config generation and
the last reload's time and result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cacheserver.config import ServerConfig, TlsFiles, load_config, read_config_text
from kvcommon.errors import PermissionDenied
from policy.access_change import AccessChange
from policy.config_text import ConfigText
from policy.identity import Principal

log = logging.getLogger(__name__)
RESTART = "needs a restart; put it back to reload the rest, or restart the server"


@dataclass(frozen=True)
class ConfigSource:
    """Where the running config came from: the file, and what the command line laid
    over it (flags override the file, at a reload as at start-up)."""

    path: Path
    overrides: Callable[[ServerConfig], ServerConfig] = lambda config: config
    tls: TlsFiles | None = None  # --tls-cert/--tls-key/--tls-client-ca, over [tls]

    def load(self) -> tuple[ServerConfig, TlsFiles | None, ConfigText]:
        """The file's config with the flags laid over it, its TLS files, and its text
        (for errors that name a line). ConfigError: one line saying what to change."""
        config = self.overrides(load_config(self.path))
        text = read_config_text(self.path)
        return config, self.tls or config.tls, ConfigText(str(self.path), text)


@dataclass(frozen=True)
class ReloadOutcome:
    applied: bool
    message: str  # one line: what changed, or what to change
    generation: int  # the config generation serving now (1: the one started with)


def check_live(old: ServerConfig, new: ServerConfig, text: ConfigText) -> None:
    """ConfigError (one line: file, line, key) for the first change in `new` that only a
    restart can make."""
    for path, before, after in _restart_keys(old, new):
        if before != after:
            raise text.error(path, f"changed; {RESTART}")
    _check_limits(old, new, text)
    _check_tls_shape(old.tls, new.tls, text)
    _check_tenants(old, new, text)


def _restart_keys(
    old: ServerConfig, new: ServerConfig
) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    for key in ("listen", "data_dir", "allow_insecure_listen", "audit_log", "secret_file"):
        yield (key,), getattr(old, key), getattr(new, key)
    for table in ("storage", "telemetry", "bulk"):
        before, after = getattr(old, table), getattr(new, table)
        for spec in fields(before):
            yield (table, spec.name), getattr(before, spec.name), getattr(after, spec.name)
    yield ("redis_cluster",), old.redis_cluster, new.redis_cluster


def _check_limits(old: ServerConfig, new: ServerConfig, text: ConfigText) -> None:
    """`[limits]` apply live (cacheserver.reloader), but for what a resource built at
    start-up holds fixed."""
    if old.limits.max_message_bytes != new.limits.max_message_bytes:
        raise text.error(
            ("limits", "max_message_bytes"),
            "changed; gRPC's largest message is fixed when its server is built at start-up, "
            f"so this {RESTART}",
        )
    if old.redis_cluster is not None and (old.limits.max_block_bytes != new.limits.max_block_bytes):
        raise text.error(
            ("limits", "max_block_bytes"),
            "changed; with [redis_cluster], the shared tier sizes its values by it at "
            f"start-up, so this {RESTART}",
        )


def _check_tls_shape(old: TlsFiles | None, new: TlsFiles | None, text: ConfigText) -> None:
    if (old is None) != (new is None):
        raise text.error(("tls",), f"turning TLS on or off {RESTART}")
    if old is not None and new is not None and (old.client_ca is None) != (new.client_ca is None):
        raise text.error(("tls", "client_ca"), f"turning mutual TLS on or off {RESTART}")


def _check_tenants(old: ServerConfig, new: ServerConfig, text: ConfigText) -> None:
    """A tenant's epoch names its blocks, and the public scope's presence orders the
    store: both fixed at start-up. A new tenant starts at epoch 0."""
    assert old.access is not None and new.access is not None
    epochs = {t.id: t.epoch for t in old.access.tenants}
    for i, tenant in enumerate(new.access.tenants):
        if tenant.epoch != epochs.get(tenant.id, 0):
            raise text.error(
                ("tenants", i, "epoch"),
                "a tenant's epoch changes (or a new tenant starts past 0) only with a "
                f"restart; {RESTART}",
            )
    if (old.access.public is None) != (new.access.public is None):
        raise text.error(("public",), f"adding or removing the public scope {RESTART}")
    if old.redis_cluster is not None:
        # The shared tier takes its tenants, their tags and quotas once, at start-up
        # (cacheserver.tiers.cluster), the same on every server that shares it.
        before = [(t.id, t.quota_bytes) for t in old.access.tenants]
        after = [(t.id, t.quota_bytes) for t in new.access.tenants]
        if before != after:
            changed = next(
                (i for i, (b, a) in enumerate(zip(before, after, strict=False)) if b != a), None
            )
            where: tuple[str | int, ...] = ("tenants",) if changed is None else ("tenants", changed)
            raise text.error(
                where,
                "with [redis_cluster], tenants and their quotas change only with a restart "
                "of every server that shares it; put them back to reload the rest",
            )
    old_public, new_public = old.access.public, new.access.public
    if old_public is not None and new_public is not None and old_public.epoch != new_public.epoch:
        raise text.error(("public", "epoch"), f"changed; {RESTART}")


def require_admin(is_admin: bool, principal: Principal) -> None:
    if not is_admin:
        raise PermissionDenied(
            f"principal {principal.name!r} may not reload the server's config; grant it "
            "the `admin` action ([[principals]] actions)"
        )


@dataclass
class ReloadState:
    """The figures a reload leaves for metrics and the admin call."""

    generation: int = 1
    last_at_s: float = 0.0  # wall clock of the last reload tried; 0: none yet
    last_ok: bool = True
    last_message: str = ""

    def note(self, ok: bool, message: str) -> None:
        self.last_at_s = time.time()
        self.last_ok = ok
        self.last_message = message
        if ok:
            self.generation += 1


def describe(change: AccessChange, ended_calls: int, closed: int, tickets: int) -> str:
    cut = (
        f"; calls ended {ended_calls}, bulk connections closed {closed}, tickets dropped {tickets}"
    )
    return change.summary() + (cut if change.closed else "")
