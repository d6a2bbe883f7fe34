"""A bulk read worker admits each request with the request core's own admission, on
the grants the server delegated (cacheserver.core.readonly): a principal the server's
policy does not let read gets nothing from the worker, which hands its reads back for
the server to refuse (and audit, once), while a principal that reads is served by the
worker. The real server, its real worker process, real TCP bulk clients.

(That the worker applies the server's rule itself, not a copy of it, even when the
rule changes after delegation: tests/unit/cacheserver/transport/bulk/test_readworker.py.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from cacheserver.config import BulkConfig
from cacheserver.transport.bulk.delegation import REPORT_INTERVAL_S
from kvcommon.errors import PermissionDenied
from policy.audit import read_records
from tests.support.bulk_workers import assembly, pair, served_by_workers, wait_in_lmdb
from tests.support.servers import Running

pytestmark = pytest.mark.slow  # every test here takes seconds

MODEL = "workers/model"
PRINCIPALS = {
    "a": (["alpha"], ["read", "write"]),
    "w": (["alpha"], ["write"]),  # may put to alpha, never read it
    "root": (["alpha", "beta"], ["read", "write", "admin"]),
}


def test_a_principal_that_may_not_read_is_refused_by_the_server_not_served_by_the_worker(
    start_server: Callable[..., Running],
) -> None:
    running = start_server(bulk=BulkConfig(workers=2), principals=PRINCIPALS)
    digests = [os.urandom(32) for _ in range(3)]
    payloads = [os.urandom(4096) for _ in digests]
    a_main, a_worker = pair(running, "a")  # connections 1 (the server's) and 2 (the worker's)
    w_main = running.client("w", transport="bulk-tcp")
    w_worker = running.client("w", transport="bulk-tcp")
    with a_main, a_worker, w_main, w_worker:
        # A put opens each of w's connections (3: the server's, 4: the worker's); the
        # worker hands w's put back and the server stores it.
        assert w_main.put("alpha", MODEL, digests[:1], payloads[:1]) == [True]
        assert w_worker.put("alpha", MODEL, digests[1:], payloads[1:]) == [True, True]
        wait_in_lmdb(running)
        time.sleep(2 * REPORT_INTERVAL_S)  # any report of the pairs' first reads is in
        # Positive control: a's reads of the same blocks are served by the worker (its
        # served counters, reported to the server).
        before = assembly(running).processes.reports
        assert a_worker.get("alpha", MODEL, digests) == payloads
        assert a_worker.lookup("alpha", MODEL, digests) == 3
        assert served_by_workers(running, before)
        time.sleep(2 * REPORT_INTERVAL_S)
        # w may not read: on the worker's connection as on the server's, each read is
        # the server's to refuse; the worker serves none of them.
        before = assembly(running).processes.reports
        for client in (w_worker, w_main, w_worker):
            with pytest.raises(PermissionDenied):
                client.get("alpha", MODEL, digests)
            with pytest.raises(PermissionDenied):
                client.lookup("alpha", MODEL, digests)
        assert not served_by_workers(running, before, timeout_s=1.0)
        assert w_worker.transport_stats.bulk_fallbacks == 0
    running.stop()
    denied = [
        r
        for r in read_records(running.config.audit_log_path)
        if r["event"] == "denied" and r["principal"] == "w"
    ]
    assert len(denied) == 6  # each refusal audited once, by the server
