"""The server's gauges: figures read from their owners when metrics are collected, so
requests pay nothing for them (tier and tenant sizes, health, what waits for the disk,
the cluster tier, the bulk channel's arenas, the config's reloads, the build).

Each `watch_*` is given a callable by the server that owns the figure (cacheserver.server)
and registers observable instruments on the meter of `ServerTelemetry`; the same rules as
its counters hold (cacheserver.telemetry): label values from fixed sets or configured
tenants, tenant labels only with `per_tenant_labels`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from importlib import metadata

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from policy.types import TenantId


class ServerGauges:
    """The observable instruments of one server, on `meter`.

    `serving` and `cluster_reachable` are set by the health monitors (cacheserver.health,
    through cacheserver.server) and read by their gauges."""

    def __init__(self, meter: metrics.Meter, *, per_tenant_labels: bool) -> None:
        self._meter = meter
        self._per_tenant_labels = per_tenant_labels
        self.serving = True  # kept by the server's health monitor
        self.cluster_reachable = True  # kept by the cluster's health monitor
        version = {"version": _package_version()}
        meter.create_observable_gauge(
            "kvshare.build_info",
            [lambda _: [Observation(1, version)]],
            "1",
            "1, labelled with the server's package version",
        )

    def watch(
        self,
        tier_usage: Callable[[], Mapping[str, tuple[int, int, int]]],
        tenant_usage: Callable[[], Mapping[TenantId, tuple[int, int]]],
    ) -> None:
        """Gauges read at collection time: tier sizes, health; per tenant if enabled.

        `tier_usage()`: tier -> (blocks, bytes, budget); `tenant_usage()`: tenant ->
        (bytes, quota_bytes)."""

        def tiers(index: int) -> Callable[[CallbackOptions], Iterable[Observation]]:
            return lambda _: [Observation(v[index], {"tier": t}) for t, v in tier_usage().items()]

        gauge = self._meter.create_observable_gauge
        gauge("kvshare.tier.blocks", [tiers(0)], "{block}", "blocks held per tier")
        gauge("kvshare.tier.bytes", [tiers(1)], "By", "bytes held per tier")
        gauge("kvshare.tier.budget.bytes", [tiers(2)], "By", "byte budget per tier")
        gauge(
            "kvshare.health.serving",
            [lambda _: [Observation(1 if self.serving else 0)]],
            "1",
            "1 while the health check answers SERVING",
        )
        if self._per_tenant_labels:
            gauge(
                "kvshare.tenant.bytes",
                [lambda _: [Observation(b, {"tenant": t}) for t, (b, _) in tenant_usage().items()]],
                "By",
                "bytes held per tenant",
            )
            gauge(
                "kvshare.tenant.quota.bytes",
                [lambda _: [Observation(q, {"tenant": t}) for t, (_, q) in tenant_usage().items()]],
                "By",
                "quota per tenant (0: none)",
            )

    def watch_backlog(
        self,
        journal: Callable[[], tuple[int, int]],
        writer: Callable[[], tuple[int, int, int, Mapping[TenantId, int]]],
        tenants: Callable[[], Iterable[TenantId]],
    ) -> None:
        """Gauges of what waits for the disk, read at collection time from the store's
        own figures (nothing is counted per request for them).

        `journal()`: (bytes the put journal's records may take, bytes of records not
        yet drained into LMDB), (0, 0) without a journal; `writer()`: (blocks, bytes,
        bound on bytes, bytes by tenant) waiting for the disk writer; `tenants()`: the
        configured tenants, each given a series (0 when it has nothing waiting) with
        `per_tenant_labels`."""
        gauge = self._meter.create_observable_gauge
        gauge(
            "kvshare.journal.capacity.bytes",
            [lambda _: [Observation(journal()[0])]],
            "By",
            "bytes the put journal's records may take (0: no journal)",
        )
        gauge(
            "kvshare.journal.undrained.bytes",
            [lambda _: [Observation(journal()[1])]],
            "By",
            "put journal bytes of acknowledged records not yet drained into LMDB",
        )
        gauge(
            "kvshare.writer.backlog.blocks",
            [lambda _: [Observation(writer()[0])]],
            "{block}",
            "blocks waiting for the disk writer",
        )
        gauge(
            "kvshare.writer.backlog.bytes",
            [lambda _: [Observation(writer()[1])]],
            "By",
            "payload bytes waiting for the disk writer (held against max_pending_write_bytes)",
        )
        gauge(
            "kvshare.writer.backlog.limit.bytes",
            [lambda _: [Observation(writer()[2])]],
            "By",
            "max_pending_write_bytes: past it puts wait, then are refused",
        )
        if self._per_tenant_labels:

            def by_tenant(_: CallbackOptions) -> Iterable[Observation]:
                waiting = writer()[3]
                return [Observation(waiting.get(t, 0), {"tenant": t}) for t in tenants()]

            gauge(
                "kvshare.tenant.backlog.bytes",
                [by_tenant],
                "By",
                "payload bytes per tenant waiting for the disk writer",
            )

    def watch_cluster(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """The Redis Cluster tier (cacheserver.tiers.cluster): what it did, by event (hits,
        misses, failures, writes, drops, evictions, ...), and whether it answers."""
        self._meter.create_observable_counter(
            "kvshare.cluster.events",
            [lambda _: [Observation(v, {"event": e}) for e, v in counts().items()]],
            "{event}",
            "Redis Cluster tier events since start, by kind",
        )
        self._meter.create_observable_gauge(
            "kvshare.cluster.reachable",
            [lambda _: [Observation(1 if self.cluster_reachable else 0)]],
            "1",
            "1 while every Redis Cluster node answers (the kvshare.cluster health service)",
        )

    def watch_bulk(self, arenas: Callable[[], int]) -> None:
        """A gauge of the bulk channel's same-host arenas open (`arenas()`), read at
        collection time: each may hold up to [bulk] arena_bytes of memory."""
        self._meter.create_observable_gauge(
            "kvshare.bulk.arenas",
            [lambda _: [Observation(arenas())]],
            "{arena}",
            "same-host bulk connections holding a shared-memory arena",
        )

    def watch_reloads(self, figures: Callable[[], tuple[int, float, bool]]) -> None:
        """The config's live reloads (cacheserver.reload): `figures()` gives the
        generation serving, the last reload's time (Unix seconds; 0: none yet) and
        whether it was applied."""
        gauge = self._meter.create_observable_gauge
        gauge(
            "kvshare.config.generation",
            [lambda _: [Observation(figures()[0])]],
            "{generation}",
            "the config generation serving (1: the one started with; each applied reload adds 1)",
        )
        gauge(
            "kvshare.config.last_reload_timestamp",
            [lambda _: [Observation(figures()[1])]],
            "s",
            "when the last reload was tried (Unix time; 0: none yet)",
        )
        gauge(
            "kvshare.config.last_reload_success",
            [lambda _: [Observation(1 if figures()[2] else 0)]],
            "1",
            "1 when the last reload was applied (or none was tried), 0 when it was refused",
        )


def _package_version() -> str:
    """The installed kvshare distribution's version ("unknown" when run from a tree
    that was never installed)."""
    try:
        return metadata.version("kvshare")
    except metadata.PackageNotFoundError:
        return "unknown"
