"""The backlog gauges of a real server's Prometheus endpoint: the put journal's fill and
what waits for the disk writer rise while acknowledged puts wait and return to 0 once
they are drained into LMDB; the build info carries the package version."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from cacheserver.config import StorageConfig, TelemetryConfig
from cacheserver.store.journal import DATA_START, MIN_CAPACITY
from tests.support.scrape import Samples, parse, scrape_text, value
from tests.support.servers import Running, launch, write_config

MODEL = "obs/model@r1;fp32;L2;H2;D8;B4;tp0/1"
BLOCK_BYTES = 64 << 10
DAY_MS = 24 * 3600 * 1000  # puts never pause long enough for the writer: it waits
POLL_S = 60.0  # a generous deadline for what a busy machine's writer thread does


def scraper(running: Running) -> Callable[[], Samples]:
    server = running.server.server
    assert server is not None and server.metrics_address
    return lambda: parse(scrape_text(server.metrics_address))


def poll(scrape: Callable[[], Samples], reached: Callable[[Samples], bool]) -> Samples:
    deadline = time.monotonic() + POLL_S
    samples = scrape()
    while not reached(samples) and time.monotonic() < deadline:
        time.sleep(0.05)
        samples = scrape()
    return samples


def backlog(samples: Samples) -> dict[str, float]:
    return {
        name: value(samples, f"kvshare_{name}")
        for name in (
            "journal_undrained_bytes",
            "writer_backlog_blocks",
            "writer_backlog_bytes",
        )
    }


def test_journal_and_writer_gauges_rise_while_puts_wait_and_fall_after_the_drain(
    tmp_path: Path,
) -> None:
    tenancy = write_config(tmp_path)
    storage = StorageConfig(journal_bytes=MIN_CAPACITY, drain_idle_ms=DAY_MS)
    telemetry = TelemetryConfig(metrics_listen="127.0.0.1:0", per_tenant_labels=True)
    alpha = [os.urandom(32) for _ in range(4)]
    beta = [os.urandom(32) for _ in range(2)]
    with launch(tenancy, storage=storage, telemetry=telemetry) as running:
        scrape = scraper(running)
        idle = scrape()
        assert value(idle, "kvshare_journal_capacity_bytes") == MIN_CAPACITY - DATA_START
        assert value(idle, "kvshare_writer_backlog_limit_bytes") == storage.max_pending_write_bytes
        assert backlog(idle) == dict.fromkeys(backlog(idle), 0.0)
        assert value(idle, "kvshare_tenant_backlog_bytes", tenant="beta") == 0
        assert ("kvshare_tenant_backlog_bytes", frozenset({("tenant", "beta")})) in idle

        with running.client("a", bulk=False) as a, running.client("b", bulk=False) as b:
            a.put("alpha", MODEL, alpha, [os.urandom(BLOCK_BYTES) for _ in alpha])
            b.put("beta", MODEL, beta, [os.urandom(BLOCK_BYTES) for _ in beta])
            # Acknowledged, and waiting: the writer holds them for a pause of a day.
            waiting = poll(scrape, lambda s: backlog(s)["writer_backlog_blocks"] >= 6)
            figures = backlog(waiting)
            assert figures["journal_undrained_bytes"] >= 6 * BLOCK_BYTES
            assert figures["writer_backlog_blocks"] == 6
            assert figures["writer_backlog_bytes"] == 6 * BLOCK_BYTES
            tenant = "kvshare_tenant_backlog_bytes"
            assert value(waiting, tenant, tenant="alpha") == 4 * BLOCK_BYTES
            assert value(waiting, tenant, tenant="beta") == 2 * BLOCK_BYTES
            assert running.store.undrained_blocks == 6  # what the gauges report

            # A delete waits for the writer to pass every record before it: the drain.
            assert a.delete("alpha", MODEL, alpha[:1]) == 1
            drained = poll(scrape, lambda s: not any(backlog(s).values()))
            assert backlog(drained) == dict.fromkeys(backlog(drained), 0.0)
            assert value(drained, tenant, tenant="alpha") == 0
            assert running.store.undrained_blocks == 0
            assert a.get("alpha", MODEL, alpha[1:2]) != []  # in LMDB, and served


def test_build_info_carries_the_package_version(tmp_path: Path) -> None:
    """And without `per_tenant_labels` no backlog series names a tenant (the test
    above, with them on, is the positive control)."""
    tenancy = write_config(tmp_path)
    telemetry = TelemetryConfig(metrics_listen="127.0.0.1:0")
    with launch(tenancy, telemetry=telemetry) as running:
        with running.client("a", bulk=False) as a:
            a.put("alpha", MODEL, [os.urandom(32)], [os.urandom(BLOCK_BYTES)])
        samples = scraper(running)()
    info = {dict(labels)["version"]: v for (name, labels), v in samples.items()
            if name == "kvshare_build_info"}  # fmt: skip
    assert info == {metadata.version("kvshare"): 1.0}
    assert "kvshare_writer_backlog_bytes" in {name for name, _ in samples}
    assert not any("tenant" in dict(labels) for _, labels in samples)
